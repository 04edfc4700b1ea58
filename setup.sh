#!/usr/bin/env bash
# Install Tessera into a virtual environment (.venv by default). Safe to re-run.
#
#   bash setup.sh                  # CPU build of JAX
#   bash setup.sh DEVICE=gpu       # NVIDIA GPUs (CUDA 12 wheels)
#   bash setup.sh DEVICE=tpu       # Cloud TPU VMs (libtpu)
#
# Settings (as KEY=VALUE arguments or environment variables):
#   DEVICE=cpu|gpu|tpu  which JAX build to install (default cpu)
#   MODE=stable         released packages from PyPI (the only mode today)
#   VENV=.venv          where the virtual environment lives
#   PYTHON=/path/python use this interpreter instead of searching for one (needs >= 3.11)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

for arg in "$@"; do
  case "$arg" in
    DEVICE=*|MODE=*|VENV=*|PYTHON=*) export "$arg" ;;
    *) echo "setup.sh: unknown argument '$arg' (expected DEVICE=cpu|gpu|tpu, MODE=stable, VENV=dir, PYTHON=path)" >&2; exit 2 ;;
  esac
done
DEVICE=${DEVICE:-cpu}
MODE=${MODE:-stable}
VENV=${VENV:-.venv}
case "$DEVICE" in cpu|gpu|tpu) ;; *) echo "setup.sh: DEVICE=$DEVICE is not one of cpu, gpu, tpu" >&2; exit 2 ;; esac
case "$MODE" in stable) ;; *) echo "setup.sh: MODE=$MODE is not supported; use MODE=stable" >&2; exit 2 ;; esac

# Print "major.minor" of a working interpreter with venv support, or nothing.
py_version() {
  "$1" -c 'import sys, venv, ensurepip; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

# Find a Python >= 3.11, preferring 3.12 (the newest JAX releases need it), then 3.13, then 3.11.
find_python() {
  local candidates=() c v
  [ -n "${PYTHON:-}" ] && { echo "$PYTHON"; return; }
  for c in python3.12 python3.13 python3.11 python3; do
    command -v "$c" >/dev/null 2>&1 && candidates+=("$(command -v "$c")")
  done
  if command -v pyenv >/dev/null 2>&1; then
    for c in "$(pyenv root)"/versions/3.1[1-3]*/bin/python3; do [ -x "$c" ] && candidates+=("$c"); done
  fi
  for want in 3.12 3.13 3.11; do
    for c in "${candidates[@]}"; do
      v=$(py_version "$c")
      [ "$v" = "$want" ] && { echo "$c"; return; }
    done
  done
}

if [ -x "$VENV/bin/python" ] && [ -n "$(py_version "$VENV/bin/python")" ]; then
  echo "setup.sh: reusing $VENV ($("$VENV/bin/python" --version))"
else
  PY=$(find_python)
  if [ -z "$PY" ]; then
    echo "setup.sh: no Python 3.11, 3.12 or 3.13 with the venv module was found." >&2
    echo "  Install Python 3.12 (e.g. 'pyenv install 3.12', 'apt install python3.12-venv' or python.org)" >&2
    echo "  and re-run, or point to one: bash setup.sh PYTHON=/path/to/python3.12" >&2
    exit 1
  fi
  v=$(py_version "$PY")
  if [ -z "$v" ] || [ "$(printf '%s\n3.11\n' "$v" | sort -V | head -1)" != "3.11" ]; then
    echo "setup.sh: $PY is not a usable Python >= 3.11 with venv (version: ${v:-unknown})" >&2
    exit 1
  fi
  [ "$v" = "3.11" ] && echo "setup.sh: note: using Python 3.11; the newest JAX releases need 3.12, so an older JAX is installed"
  echo "setup.sh: creating $VENV with $PY (Python $v)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q -r requirements.txt
JAX_VERSION=$("$VENV/bin/python" -c 'import jax; print(jax.__version__)')
case "$DEVICE" in
  gpu) "${PIP[@]}" install -q "jax[cuda12]==$JAX_VERSION" ;;
  tpu) "${PIP[@]}" install -q "jax[tpu]==$JAX_VERSION" ;;
esac
"${PIP[@]}" install -q --no-deps -e .

echo "setup.sh: done (DEVICE=$DEVICE, jax $JAX_VERSION, $("$VENV/bin/python" --version))."
echo "  Train the tiny model:  $VENV/bin/python train.py configs/base.yml run_name=demo"
echo "  Run the tests:         $VENV/bin/python -m pytest -q tests"
