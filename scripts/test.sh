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
exit $rc
