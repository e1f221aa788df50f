#!/usr/bin/env bash
# Run every test: set up (idempotent), generate the fixtures, ctest, then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k mtmd -x).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PRESET="${VIS_PRESET:-cpu}"
bash scripts/setup.sh
VPY="$ROOT/.venv/bin/python"

printf '\n== fixtures\n'
"$VPY" -m pyvis.cli fixtures

printf '\n== ctest\n'
ctest --preset "$PRESET" --output-on-failure

printf '\n== pytest\n'
set +e
"$VPY" -m pytest "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi

# opt-in, off by default: VIS_TEST_CUDA_CHECK="cuda 86" (or "jetson") also compiles that CUDA preset without a GPU
# (scripts/cuda-check.sh).  Only for a runner that keeps the ccache between runs: warm it takes under a minute,
# cold 25-37 min on 2 idle cores (jetson/README.md#checking-the-cuda-build-without-a-gpu)
if [ -n "${VIS_TEST_CUDA_CHECK:-}" ] && [ $rc -eq 0 ]; then
  printf '\n== cuda check (%s)\n' "$VIS_TEST_CUDA_CHECK"
  # shellcheck disable=SC2086  # "PRESET [ARCHS]"
  bash scripts/cuda-check.sh $VIS_TEST_CUDA_CHECK || rc=$?
fi
exit $rc
