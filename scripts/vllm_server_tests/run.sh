#!/bin/bash
# vLLM's own server tests against `jaxpaged serve` (README.md beside this file).
# usage: scripts/vllm_server_tests/run.sh VLLM_TREE [WORK_DIR] [TEST_FILE ...]
#   VLLM_TREE: a vLLM work tree (its tests/ are copied; some tests read its examples/)
#   VLLM_PY: a Python with vllm, pytest and pytest-asyncio (VLLM_PYTHONPATH is put on its path)
#   JAXPAGED_PYTHON: a Python with jaxpaged's dependencies (default: this checkout's .venv)
#   VLLM_PYTEST_ARGS: further pytest arguments for every file (e.g. "-k 'custom_role or n_parameter'")
set -euo pipefail
VLLM=$(cd "$1" && pwd)
WORK=${2:-/tmp/vllm_server_tests}
shift $(( $# < 2 ? $# : 2 ))
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VLLM_PY=${VLLM_PY:-python}
export JAXPAGED_PYTHON=${JAXPAGED_PYTHON:-$ROOT/.venv/bin/python}
FILES=("$@")
if [ ${#FILES[@]} -eq 0 ]; then
  mapfile -t FILES < <(grep -v '^#' "$HERE/files.txt" | sed '/^$/d')
fi
rm -rf "$WORK" && mkdir -p "$WORK/tests"
for f in "${FILES[@]}"; do
  mkdir -p "$WORK/$(dirname "$f")" && cp "$VLLM/$f" "$WORK/$f"
  d=$(dirname "$f")
  while [ "$d" != "tests" ] && [ "$d" != "." ]; do  # each package's __init__.py and conftest.py
    for extra in __init__.py conftest.py; do
      [ -f "$VLLM/$d/$extra" ] && cp "$VLLM/$d/$extra" "$WORK/$d/$extra"
    done
    touch "$WORK/$d/__init__.py"
    d=$(dirname "$d")
  done
done
cp "$HERE/shim/tests/utils.py" "$HERE/shim/tests/conftest.py" "$WORK/tests/" && touch "$WORK/tests/__init__.py"
export JAXPAGED_ROOT=$ROOT VLLM_TREE=$VLLM
export JAXPAGED_MODEL_DIR=${JAXPAGED_MODEL_DIR:-$(PYTHONPATH=$ROOT "$JAXPAGED_PYTHON" -c \
  "from jaxpaged.checkpoints.default_model import default_model_dir; print(default_model_dir())")}
export JAXPAGED_LOG_DIR=$WORK/logs  # each server's log, serve-PORT.log
mkdir -p "$JAXPAGED_LOG_DIR"
cd "$WORK"
eval "PYTEST_EXTRA=(${VLLM_PYTEST_ARGS:-})"  # the words of VLLM_PYTEST_ARGS, quotes as the shell reads them
for f in "${FILES[@]}"; do  # one pytest per file: each file's report is kept whatever happens to the next
  name=$(basename "$f" .py)
  PYTHONPATH="$WORK:${VLLM_PYTHONPATH:-}" "$VLLM_PY" -m pytest -p no:cacheprovider -v -rfEs \
    -o asyncio_default_fixture_loop_scope=function --junitxml="$WORK/junit-$name.xml" \
    ${VLLM_PYTEST_ARGS:+"${PYTEST_EXTRA[@]}"} "$f" \
    > "$WORK/pytest-$name.log" 2>&1 || true
  tail -1 "$WORK/pytest-$name.log"
done
"$VLLM_PY" "$HERE/summarize.py" "$WORK"/junit-*.xml
