#!/usr/bin/env bash
# Prepare .devcarry/ for scripts/gpu-check.sh on a lent GPU machine that has no network and no venv (the `device`
# tool's machines): the patched upstream tree as a tarball (a CUDA build made here is ~67 MB for one architecture,
# more than the 64 MiB that travel), gguf-py, a GGUF holding only SmolLM2's tokenizer keys (the fixtures' tokenizer),
# and the vendor stamp.  Then, with the device tool (carry [".devcarry"]):
#
#   bash scripts/gpu-device.sh "2 4 5" 400     # build the cuda preset there (~300 s on 16 cores), then those steps
#
# Needs scripts/setup.sh to have run here (.venv, vendor/).  .devcarry/ is git-ignored (.git/info/exclude).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[ -x .venv/bin/python ] && [ -f vendor/.llama.cpp-stamp ] || { echo "error: run bash scripts/setup.sh first" >&2; exit 1; }
mkdir -p .git/info && { grep -qx "/.devcarry/" .git/info/exclude 2>/dev/null || echo "/.devcarry/" >> .git/info/exclude; }
rm -rf .devcarry && mkdir -p .devcarry
(cd vendor && tar cf - --exclude='llama.cpp/models/*' llama.cpp/ggml llama.cpp/src llama.cpp/include llama.cpp/common \
    llama.cpp/tools llama.cpp/vendor llama.cpp/cmake llama.cpp/CMakeLists.txt llama.cpp/licenses llama.cpp/LICENSE \
    llama.cpp/scripts/*.cmake | xz -T2 -3 > ../.devcarry/vendor.tar.xz)
cp vendor/.llama.cpp-stamp .devcarry/stamp
cp -r "$(.venv/bin/python -c 'import gguf, os; print(os.path.dirname(gguf.__file__))')" .devcarry/gguf
.venv/bin/python - <<'PY'
import gguf
from pyvis.fixtures.tokenizer import tokenizer_fields
w = gguf.GGUFWriter(".devcarry/tok.gguf", "llama")
for k, v, t, sub in tokenizer_fields():
    if t == gguf.GGUFValueType.ARRAY:
        w.add_key_value(k, list(v), t, sub_type=sub)
    else:
        w.add_key_value(k, v, t)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
PY
echo ".devcarry: $(du -sh .devcarry | cut -f1) (the tracked tree: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes; 64 MiB travel in all)"
