#!/usr/bin/env bash
# Install Tessera into a virtual environment (.venv by default). Safe to re-run.
#
#   bash setup.sh                  # CPU build of JAX, exact versions from locks/cpu.txt
#   bash setup.sh DEVICE=gpu       # NVIDIA GPUs (CUDA 12 wheels), locks/gpu.txt
#   bash setup.sh DEVICE=tpu       # Cloud TPU VMs (libtpu), locks/tpu.txt
#   bash setup.sh HF_REFERENCE=1   # also the Hugging Face reference env for the parity tests
#   bash setup.sh MODE=latest      # newest releases within requirements*.txt instead of the lock
#   bash setup.sh lock             # refresh locks/*.txt from requirements*.txt (maintainers), then exit
#
# Settings (as KEY=VALUE arguments or environment variables; an argument wins, and an error says when a
# value came from the environment):
#   DEVICE=cpu|gpu|tpu  which JAX build to install (default cpu; gpu and tpu on Linux only)
#   MODE=locked|latest  locked (default; 'stable' is the same): the exact versions CI tested, from
#                       locks/<DEVICE>.txt. latest: resolve the ranges in requirements*.txt anew
#   VENV=.venv          where the virtual environment lives (relative to setup.sh's folder; a folder
#                       that exists and is not a virtual environment is refused, never deleted; one
#                       installed for DEVICE=gpu is refused for another DEVICE: pip would leave CUDA in it)
#   PYTHON=/path/python use this interpreter instead of searching for one (needs >= 3.11); an
#                       existing VENV of another Python version is refused, not replaced
#   HF_REFERENCE=0|1    1 also installs locks/hf.txt (transformers) and torch (requirements-hf.txt)
#                       into HF_VENV, a second venv that the parity tests and check_logits call as
#                       a subprocess (default 0). Prefers Python 3.11, whose PyTorch CPU build is
#                       on disk on our dev/CI machines; elsewhere set TORCH_INDEX_URL too. Installed
#                       while the main environment is (its output, shown after: $HF_VENV/setup.log)
#   HF_VENV=.venv-hf    where the reference environment lives (elsewhere, the parity tests find it
#                       through TESSERA_HF_PYTHON=$HF_VENV/bin/python)
#   TORCH_INDEX_URL=url with HF_REFERENCE=1: install torch from this index (a CPU wheel index
#                       avoids a multi-GB CUDA build)
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh setup.sh` starts a POSIX shell: run under bash
set -euo pipefail
CALLER_DIR=$PWD
cd "$(dirname "${BASH_SOURCE[0]}")"

# The settings set in the caller's environment (node-gyp's users export PYTHON, for one): an error names them.
FROM_ENV=" "
for name in DEVICE MODE VENV PYTHON HF_REFERENCE HF_VENV TORCH_INDEX_URL; do
  if [ -n "${!name:-}" ]; then FROM_ENV="$FROM_ENV$name "; fi
done
# from_env NAME: " (set in your environment: ...)" when the setting came from there, else nothing.
from_env() {
  case "$FROM_ENV" in
    *" $1 "*) echo " (set in your environment, not on the command line: unset $1 for the default)" ;;
  esac
}

COMMAND=install
GIVEN=" "  # the settings given as arguments
for arg in "$@"; do
  case "$arg" in
    DEVICE=*|MODE=*|VENV=*|PYTHON=*|HF_REFERENCE=*|HF_VENV=*|TORCH_INDEX_URL=*)
      export "$arg"
      GIVEN="$GIVEN${arg%%=*} "
      FROM_ENV=${FROM_ENV/ ${arg%%=*} / } ;;
    lock) COMMAND=lock ;;
    -h|--help) sed -n '2,/^[^#]/p' "$(basename "${BASH_SOURCE[0]}")" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (expected DEVICE=cpu|gpu|tpu, MODE=locked|latest, VENV=dir, PYTHON=path, HF_REFERENCE=0|1, HF_VENV=dir, TORCH_INDEX_URL=url, or 'lock'; see bash setup.sh --help)" >&2; exit 2 ;;
  esac
done
DEVICE=${DEVICE:-cpu}
MODE=${MODE:-locked}
[ "$MODE" = stable ] && MODE=locked
VENV=${VENV:-.venv}
HF_REFERENCE=${HF_REFERENCE:-0}
HF_VENV=${HF_VENV:-.venv-hf}
case "$DEVICE" in cpu|gpu|tpu) ;; *) echo "setup.sh: DEVICE=$DEVICE is not one of cpu, gpu, tpu$(from_env DEVICE)" >&2; exit 2 ;; esac
if [ "$DEVICE" != cpu ] && [ "$(uname -s 2>/dev/null || true)" != Linux ]; then
  # pip failed half-way with "No matching distribution found for jax-cuda12-plugin" (or libtpu)
  echo "setup.sh: DEVICE=$DEVICE$(from_env DEVICE) needs Linux: JAX's CUDA and TPU builds are made for Linux only," \
    "and this is $(uname -s 2>/dev/null || echo 'an unknown system'); use DEVICE=cpu here" >&2
  exit 2
fi
case "$MODE" in locked|latest) ;; *) echo "setup.sh: MODE=$MODE is not one of locked, latest$(from_env MODE)" >&2; exit 2 ;; esac
UV_VERSION=0.13.9   # the resolver that writes locks/*.txt (bash setup.sh lock)
PIP_VERSION=26.3    # the pip every environment is brought to: a new pip release cannot change an install
START=$SECONDS
case "$HF_REFERENCE" in 0|1) ;; *) echo "setup.sh: HF_REFERENCE=$HF_REFERENCE is not one of 0, 1$(from_env HF_REFERENCE)" >&2; exit 2 ;; esac
for name in TORCH_INDEX_URL HF_VENV; do  # typed for the reference environment, which was then not installed
  if [ "$HF_REFERENCE" = 0 ] && [[ "$GIVEN" == *" $name "* ]]; then
    echo "setup.sh: warning: $name is read with HF_REFERENCE=1 only (the reference environment); add HF_REFERENCE=1" \
      "to install it" >&2
  fi
done
# A leading ~ that reached us unexpanded (zsh, macOS's shell, leaves VENV=~/envs/t alone; so do quotes) is the
# home folder: VENV=~/envs/t was a folder named '~' inside the repository, PYTHON=~/bin/python3 a missing file.
for name in VENV HF_VENV PYTHON; do
  case "${!name:-}" in "~"|"~/"*) printf -v "$name" '%s' "$HOME${!name#\~}" ;; esac
done
# PYTHON=some/dir/python names a file from where setup.sh was started (a bare name is looked up on PATH).
case "${PYTHON:-}" in /*|"") ;; */*) PYTHON=$CALLER_DIR/$PYTHON ;; esac
# The editable install writes src/tessera.egg-info here (and runs write outputs/ here).
if [ ! -w . ] || { [ -e src ] && [ ! -w src ]; }; then
  echo "setup.sh: cannot write in $PWD (the install writes src/tessera.egg-info there);" \
    "clone the repository into a folder you own and run setup.sh there" >&2
  exit 1
fi

# A fresh environment takes about 2 GB for DEVICE=cpu or tpu, 6 GB for gpu (CUDA wheels), and the
# reference environment (HF_REFERENCE=1) 1.5 GB: stop before a half-written one on a short disk.
# check_free_space DIR GB WHAT
check_free_space() {
  local free_kb dir=$1
  # a folder still to be made (VENV=/new/place/venv): its nearest existing parent's disk. df failed on it, and
  # with pipefail the assignment ended setup.sh silently, exit 1
  while [ ! -d "$dir" ] && [ "$dir" != "$(dirname "$dir")" ]; do dir=$(dirname "$dir"); done
  free_kb=$(df -Pk "$dir" 2>/dev/null | awk 'NR == 2 {print $4}') || free_kb=""
  if [ -n "$free_kb" ] && [ "$free_kb" -lt $(($2 * 1024 * 1024)) ]; then
    echo "setup.sh: only $((free_kb / 1024)) MB free on the disk of $1; $3 needs about $2 GB." >&2
    echo "  Free some space, or put it on another disk (VENV=/path or HF_VENV=/path), and re-run." >&2
    exit 1
  fi
}

# Print "major.minor" of a working interpreter with venv support, or nothing.
py_version() {
  "$1" -c 'import sys, venv, ensurepip; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

# Find a Python of one of the given versions, in the order given (on PATH and in pyenv's folder,
# also when pyenv itself is not on PATH); prints nothing, and succeeds, when there is none.
find_python() {
  local candidates=() c v want root=${PYENV_ROOT:-$HOME/.pyenv}
  for c in python3.12 python3.13 python3.11 python3; do
    command -v "$c" >/dev/null 2>&1 && candidates+=("$(command -v "$c")")
  done
  command -v pyenv >/dev/null 2>&1 && root=$(pyenv root)
  for c in "$root"/versions/3.1[1-3]*/bin/python3; do [ -x "$c" ] && candidates+=("$c"); done
  for want in "$@"; do
    for c in "${candidates[@]}"; do
      v=$(py_version "$c")
      if [ "$v" = "$want" ]; then echo "$c"; return 0; fi
    done
  done
  return 0
}

# "PATH (Python X.Y)" for each version 3.14 or newer with the venv module (the first found of each: PATH, then
# pyenv's folder), one a line: find_python leaves them out (the lock is tested on 3.11 to 3.13); PYTHON= may name one.
newer_pythons() {
  local c v root=${PYENV_ROOT:-$HOME/.pyenv} seen=" "
  command -v pyenv >/dev/null 2>&1 && root=$(pyenv root)
  for c in $(compgen -c python3 | grep -E '^python3(\.[0-9]+)?$' | sort -u) "$root"/versions/3.*/bin/python3; do
    c=$(command -v "$c" 2>/dev/null) || continue
    v=$(py_version "$c")
    case "$seen" in *" $v "*) continue ;; esac
    seen="$seen$v "
    [ -n "$v" ] && [ "$(printf '%s\n3.14\n' "$v" | sort -V | head -1)" = 3.14 ] && echo "$c (Python $v)"
  done
  return 0
}

# make_venv PYTHON DIR VERSION: a new virtual environment in DIR. An old environment there is
# replaced; anything else that is not empty is refused (no pyvenv.cfg): never delete someone's files.
make_venv() {
  if [ -e "$2" ] && [ ! -f "$2/pyvenv.cfg" ] && { [ ! -d "$2" ] || [ -n "$(ls -A "$2")" ]; }; then
    echo "setup.sh: $2 exists and is not a virtual environment (no pyvenv.cfg), so it was left alone;" \
      "choose another folder (VENV=dir, HF_VENV=dir) or move it away, and re-run" >&2
    exit 1
  fi
  echo "setup.sh: creating $2 with $1 (Python $3)"
  rm -rf "$2"
  if ! "$1" -m venv "$2"; then
    echo "setup.sh: '$1 -m venv $2' failed (see above); check that $(dirname "$2") is writable," \
      "or choose another folder (VENV=dir, HF_VENV=dir), and re-run" >&2
    exit 1
  fi
}

# Does this environment have pip? A setup that was interrupted while the environment was being made
# leaves one without it, which is made anew.
has_pip() {
  "$1" -c 'import pip' >/dev/null 2>&1
}

# The Hugging Face reference environment (HF_REFERENCE=1): PyTorch + transformers in $HF_VENV,
# its own interpreter, so that torch never has to match the main venv's Python. Made in two parts: the
# checks and the empty environment first (an error stops setup.sh before anything is installed), then
# the packages, which install_hf_packages puts in alongside the main environment's.
prepare_hf_venv() {
  local py
  HF_V=$(py_version "$HF_VENV/bin/python")
  has_pip "$HF_VENV/bin/python" || HF_V=
  case "$HF_V" in
    3.11|3.12|3.13) echo "setup.sh: reusing $HF_VENV ($("$HF_VENV/bin/python" --version))" ;;
    *)
      # Prefer 3.11: on our dev/CI machines PyTorch's CPU build lies on disk for it.
      check_free_space "$(dirname "$HF_VENV")" 2 "the reference environment in $HF_VENV"
      py=$(find_python 3.11 3.12 3.13)
      if [ -z "$py" ]; then
        echo "setup.sh: HF_REFERENCE=1 needs a Python 3.11, 3.12 or 3.13 with the venv module; none was found." >&2
        echo "  Install one (e.g. 'pyenv install 3.11' or 'apt install python3.11-venv') and re-run." >&2
        exit 1
      fi
      HF_V=$(py_version "$py")
      make_venv "$py" "$HF_VENV" "$HF_V"
      ;;
  esac
  if [ "$HF_V" != 3.11 ] && [ -z "${TORCH_INDEX_URL:-}" ]; then
    echo "setup.sh: note: $HF_VENV uses Python $HF_V; if pip starts downloading a multi-GB CUDA build of torch," \
      "stop it and set TORCH_INDEX_URL to a CPU wheel index"
  fi
}

install_hf_packages() {
  local start=$SECONDS hfpip torch_req versions
  hfpip=("$HF_VENV/bin/python" -m pip --disable-pip-version-check)
  "${hfpip[@]}" install -q "pip==$PIP_VERSION"
  torch_req=$(sed -n 's/^\(torch[=<>!~][^ #]*\).*/\1/p' requirements-hf.txt)
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${hfpip[@]}" install -q --index-url "$TORCH_INDEX_URL" "$torch_req"
  else
    "${hfpip[@]}" install -q "$torch_req"
  fi
  # torch is pinned in requirements-hf.txt and left out of locks/hf.txt (the lock would otherwise
  # carry the CUDA build's nvidia-* wheels); everything else is locked.
  if [ "$MODE" = locked ]; then
    "${hfpip[@]}" install -q -r locks/hf.txt
  else
    "${hfpip[@]}" install -q --upgrade -r requirements-hf.txt
  fi
  if ! versions=$("$HF_VENV/bin/python" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'); then
    echo "setup.sh: $HF_VENV was installed but 'import torch, transformers' fails (see above)." >&2
    echo "  Delete it and re-run 'bash setup.sh HF_REFERENCE=1', or point TESSERA_HF_PYTHON at a Python with both." >&2
    exit 1
  fi
  echo "setup.sh: Hugging Face reference ready in $HF_VENV ($versions, $("$HF_VENV/bin/python" --version)); took $((SECONDS - start)) s."
  if [ "$(cd "$HF_VENV" && pwd -P)" != "$(pwd -P)/.venv-hf" ]; then
    echo "  The parity tests and check_logits look in .venv-hf: export TESSERA_HF_PYTHON=$(cd "$HF_VENV" && pwd -P)/bin/python"
  fi
}

# The reference environment's packages install in a background job while the main environment's do (most of
# either is unpacking wheels: together they take about the time of the longer one). Its output goes to
# $HF_VENV/setup.log, shown when it is done, not interleaved with the main install's.
HF_PID=
start_hf_packages() {
  set -m   # the job gets a process group of its own, which stop_hf_packages ends whole (pip with it)
  install_hf_packages < /dev/null > "$HF_VENV/setup.log" 2>&1 &
  HF_PID=$!
  set +m
  trap stop_hf_packages EXIT   # setup.sh stopped by an error or Ctrl-C: no pip left running on its own
}

stop_hf_packages() {
  if [ -n "$HF_PID" ]; then
    kill -TERM -- "-$HF_PID" 2>/dev/null || true
    wait "$HF_PID" 2>/dev/null || true
    echo "setup.sh: stopped the install of the reference environment in $HF_VENV too; re-run to finish it" >&2
  fi
}

# Wait for the reference environment's packages, show what they printed, and stop with their exit code if
# they failed.
finish_hf_packages() {
  local status=0
  [ -n "$HF_PID" ] || return 0
  wait "$HF_PID" || status=$?
  HF_PID=
  cat "$HF_VENV/setup.log"
  if [ "$status" != 0 ]; then
    echo "setup.sh: installing the reference environment in $HF_VENV failed (exit $status, see above);" \
      "the main environment in $VENV is installed. Fix the cause and re-run 'bash setup.sh HF_REFERENCE=1'" >&2
    exit "$status"
  fi
}

# bash setup.sh lock: resolve requirements*.txt with uv (pinned above) into locks/*.txt. The locks
# are universal (every platform, Python >= 3.11, with environment markers where versions differ).
refresh_locks() {
  local py uv flavour src cuda_only args tmp
  py=$(find_python 3.12 3.13 3.11)
  [ -z "$py" ] && { echo "setup.sh lock: no Python 3.11-3.13 found to run uv" >&2; exit 1; }
  tmp=$(mktemp -d)
  LOCK_TMP=$tmp
  trap 'rm -rf "$LOCK_TMP"' EXIT
  "$py" -m venv "$tmp/uv"
  "$tmp/uv/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
  uv=("$tmp/uv/bin/uv" pip compile --quiet --universal --python-version 3.11 --no-config
      --custom-compile-command "bash setup.sh lock")
  mkdir -p locks
  for flavour in cpu gpu tpu; do
    src=requirements.txt
    [ "$flavour" != cpu ] && src=requirements-$flavour.txt
    "${uv[@]}" "$src" -o "locks/$flavour.txt"
    echo "setup.sh lock: locks/$flavour.txt <- $src ($(grep -c '^[A-Za-z]' "locks/$flavour.txt") packages)"
  done
  # hf: torch stays pinned in requirements-hf.txt and is installed on its own (a CPU build); the
  # packages only its CUDA build needs are left out of the lock.
  "${uv[@]}" requirements-hf.txt -o "$tmp/hf.txt"
  args=(--no-emit-package torch)
  for cuda_only in $(grep -oE '^(nvidia-[a-z0-9-]+|cuda-[a-z-]+|triton)==' "$tmp/hf.txt" | tr -d '='); do
    args+=(--no-emit-package "$cuda_only")
  done
  "${uv[@]}" requirements-hf.txt "${args[@]}" -o locks/hf.txt
  echo "setup.sh lock: locks/hf.txt <- requirements-hf.txt ($(grep -c '^[A-Za-z]' locks/hf.txt) packages; torch from requirements-hf.txt)"
  echo "setup.sh lock: done; run the tests, then commit requirements*.txt and locks/ together."
}
if [ "$COMMAND" = lock ]; then refresh_locks; exit 0; fi

# Is this "major.minor" 3.11 or newer?
at_least_3_11() {
  [ -n "$1" ] && [ "$(printf '%s\n3.11\n' "$1" | sort -V | head -1)" = "3.11" ]
}

PY=${PYTHON:-}
if [ -n "$PY" ]; then
  v=$(py_version "$PY")
  if ! at_least_3_11 "$v"; then
    echo "setup.sh: PYTHON=$PY is not a usable Python >= 3.11 with venv (version: ${v:-unknown})$(from_env PYTHON)" >&2
    exit 1
  fi
fi
venv_v=
[ -x "$VENV/bin/python" ] && venv_v=$(py_version "$VENV/bin/python")
if [ -z "$venv_v" ] && [ -f "$VENV/pyvenv.cfg" ]; then  # it was deleted and made anew without a word
  echo "setup.sh: $VENV's Python does not run (its interpreter removed or upgraded since, e.g. by brew or" \
    "pyenv?); making it anew"
fi
if [ -n "$venv_v" ] && ! has_pip "$VENV/bin/python"; then
  echo "setup.sh: $VENV has no pip (a setup interrupted while it was being made?); making it anew"
  venv_v=
fi
if [ -n "$venv_v" ] && ! at_least_3_11 "$venv_v"; then
  echo "setup.sh: $VENV has Python $venv_v, but Tessera needs 3.11 or newer; delete it (rm -rf $VENV)" \
    "and re-run, or choose another folder (VENV=dir)" >&2
  exit 1
fi
if [ -n "$venv_v" ] && [ -n "$PY" ] && [ "$venv_v" != "$v" ]; then
  echo "setup.sh: $VENV has Python $venv_v, not the $v of PYTHON=$PY$(from_env PYTHON); to switch, delete it" \
    "(rm -rf $VENV) and re-run, or leave PYTHON unset to keep it" >&2
  exit 1
fi
# pip adds packages and removes none: the CUDA build's (6 GB) stayed in an environment re-installed for cpu or
# tpu, where JAX went on using the GPU, and the doctor found nothing wrong.
installed_for=$(sed -n 's/^DEVICE=//p' "$VENV/tessera-setup.txt" 2>/dev/null || true)
if [ -n "$venv_v" ] && [ "$installed_for" = gpu ] && [ "$DEVICE" != gpu ]; then
  echo "setup.sh: $VENV was installed for DEVICE=gpu, and its CUDA packages would stay in a DEVICE=$DEVICE" \
    "environment$(from_env DEVICE); delete it (rm -rf $VENV) and re-run, or choose another folder (VENV=dir)" >&2
  exit 1
fi

if [ -n "$venv_v" ]; then
  echo "setup.sh: reusing $VENV ($("$VENV/bin/python" --version))"
else
  if [ -z "$PY" ]; then
    # Prefer 3.12 (the newest JAX releases need it), then 3.13, then 3.11.
    PY=$(find_python 3.12 3.13 3.11)
    if [ -z "$PY" ]; then
      echo "setup.sh: no Python 3.11, 3.12 or 3.13 with the venv module was found." >&2
      newer=$(newer_pythons)
      if [ -n "$newer" ]; then
        echo "  Newer than Tessera is tested with (its lock is tested on 3.11 to 3.13), found:" >&2
        echo "$newer" | sed 's/^/    /' >&2
        first=${newer%%$'\n'*}
        echo "  To try one anyway: bash setup.sh PYTHON=${first% (Python *}" >&2
      fi
      echo "  Install Python 3.12 (e.g. 'pyenv install 3.12', 'apt install python3.12-venv' or python.org)" >&2
      echo "  and re-run, or point to one: bash setup.sh PYTHON=/path/to/python3.12" >&2
      exit 1
    fi
    v=$(py_version "$PY")
  fi
  [ "$v" = "3.11" ] && echo "setup.sh: note: using Python 3.11; the newest JAX releases need 3.12, so an older JAX is installed"
  need_gb=3; [ "$DEVICE" = gpu ] && need_gb=8
  check_free_space "$(dirname "$VENV")" "$need_gb" "a fresh DEVICE=$DEVICE environment in $VENV"
  make_venv "$PY" "$VENV" "$v"
fi

if [ "$HF_REFERENCE" = 1 ]; then prepare_hf_venv; start_hf_packages; fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q "pip==$PIP_VERSION"
if [ "$MODE" = locked ]; then
  echo "setup.sh: installing the locked versions from locks/$DEVICE.txt (MODE=latest resolves the ranges instead)"
  "${PIP[@]}" install -q -r "locks/$DEVICE.txt"
else
  ranges=requirements.txt
  [ "$DEVICE" != cpu ] && ranges=requirements-$DEVICE.txt
  echo "setup.sh: MODE=latest: resolving the newest releases within $ranges (not what CI tested)"
  "${PIP[@]}" install -q --upgrade -r "$ranges"
fi
# built with the setuptools the lock installed (requirements.txt), not the newest one on PyPI
"${PIP[@]}" install -q --no-deps -e . --no-build-isolation
printf 'DEVICE=%s\nMODE=%s\n' "$DEVICE" "$MODE" > "$VENV/tessera-setup.txt"   # read by tessera.doctor
JAX_VERSION=$("$VENV/bin/python" -c 'import jax; print(jax.__version__)')
echo "setup.sh: installed (DEVICE=$DEVICE, MODE=$MODE, jax $JAX_VERSION, $("$VENV/bin/python" --version)); took $((SECONDS - START)) s."
finish_hf_packages

# The doctor checks versions against the lock, the devices JAX sees and known-bad combinations.
status=0
"$VENV/bin/python" -m tessera.doctor --quiet || status=$?
[ "$PWD" != "$CALLER_DIR" ] && echo "  From $PWD (the commands of the docs run from there):"
echo "  Details:               $VENV/bin/python -m tessera.doctor"
echo "  Train the tiny model:  $VENV/bin/python train.py configs/base.yml run_name=demo"
echo "  Run the tests:         $VENV/bin/python -m pytest -q -n auto tests"
# A doctor verdict of 'problems' does not fail the install of a CPU-only machine asked for
# DEVICE=gpu|tpu (a login host may prepare an environment for another machine); it is printed.
if [ "$status" != 0 ] && [ "$DEVICE" = cpu ]; then
  echo "setup.sh: installed in $((SECONDS - START)) s, but the doctor found problems (above): fix them and re-run" >&2
  exit 1
fi
echo "setup.sh: done in $((SECONDS - START)) s."
exit 0
