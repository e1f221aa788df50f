#!/usr/bin/env bash
# Edit the patch series as git history (docs/architecture.md#patch-series):
#   scripts/patch-series.sh init DIR    pristine upstream in DIR (a git repo), one commit per ggml-patches/*.patch,
#                                       named after the patch file
#   ... edit in DIR; commit each change as `git commit --fixup=<the patch's commit>`, then
#       GIT_SEQUENCE_EDITOR=true git rebase -i --autosquash base   (base: the tag of the pristine commit)
#   scripts/patch-series.sh export DIR  rewrite the bodies of ggml-patches/*.patch from DIR's commits; each patch keeps
#                                       its header (the why) and its file order; hunk headers carry no function context
# Then `git diff ggml-patches/` shows what changed; a patch whose diff is only renumbered hunks is the effect of an
# earlier patch's new lines (tests/test_upstream.py requires every patch to apply without offsets).
set -euo pipefail
cmd=${1:?usage: patch-series.sh init|export DIR}; dir=${2:?usage: patch-series.sh init|export DIR}
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case $cmd in
init)
  if [ -e "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
    echo "error: $dir exists and is not empty; give a new folder (init never overwrites one)" >&2; exit 2
  fi
  $repo/.venv/bin/python $repo/scripts/upstream.py --pristine "$dir" >/dev/null
  cd "$dir"; rm -f .git; git init -q; git add -A >/dev/null; git commit -qm base; git tag base
  for p in $repo/ggml-patches/*.patch; do
    patch -p1 -s --no-backup-if-mismatch < "$p"; git add -A >/dev/null; git commit -qm "$(basename $p)"
  done
  git log --oneline | head -20;;
export)
  cd "$dir"
  for c in $(git rev-list --reverse HEAD~$(( $(ls $repo/ggml-patches/*.patch | wc -l) ))..HEAD); do
    name=$(git log -1 --format=%s $c); f=$repo/ggml-patches/$name
    python3 - "$f" "$c" <<'PY'
import subprocess, sys
f, c = sys.argv[1], sys.argv[2]
old = open(f).read(); hdr = old[:old.index('\n--- a/') + 1]
import re, tempfile
order = re.findall(r'^--- a/(\S+)', old, re.M)
with tempfile.NamedTemporaryFile('w', delete=False) as of:
    of.write('\n'.join(order) + '\n')
d = subprocess.run(['git', 'diff', '--no-color', '--no-prefix', '-O' + of.name, c + '~1', c], capture_output=True, text=True, check=True).stdout
out = []
for l in d.splitlines(keepends=True):
    if l.startswith('diff --git') or l.startswith('index ') or l.startswith('new file mode'): continue
    if l.startswith('--- ') and not l.startswith('--- /dev/null'): l = '--- a/' + l[4:]
    if l.startswith('+++ '): l = '+++ b/' + l[4:]
    if l.startswith('@@ '): l = l[:l.index(' @@', 3) + 3] + '\n'
    out.append(l)
open(f, 'w').write(hdr + ''.join(out))
PY
  done;;
*) echo "usage: patch-series.sh init|export DIR" >&2; exit 2;;
esac
