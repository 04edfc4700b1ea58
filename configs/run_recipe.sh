# Shared part of every recipe under configs/tpu and configs/gpu; recipes `source` it with
# their arguments, export their compiler flags, then call `run_recipe`.
#
# Arguments are KEY=VALUE. Upper-case keys are exported as environment variables; lower-case
# keys are config overrides appended after the recipe's own (so they win), e.g. steps=20 (and after
# compile_topology, so compile_topology=v5p-512 compiles the recipe for another slice). A config key
# in upper case (STEPS=20) is refused, naming the lower-case one.
#   RUN_NAME=name      the run's name (passed as M_RUN_NAME; default <folder>_<recipe>, e.g. v5p_128b:
#                      the same on every worker, and a second run with it resumes the first); run_name=name
#                      as an argument is taken as RUN_NAME=name (M_RUN_NAME=name is not: a warning says so)
#   OUTPUT_PATH=dir    base_output_directory: a local folder or gs://bucket/path (default outputs; with
#                      PLATFORM=gke a local folder is warned about: it is inside the container, lost with the pod)
#   DATASET_PATH=path  a TFDS data directory: trains with dataset_type=tfds dataset_path=path (add
#                      dataset_name=c4/en:3.1.0 tokenizer_path=... as overrides); without it the
#                      recipe trains on the synthetic stream
#   PLATFORM=gce|gke   gce: TPU VMs, where rto_setup.sh tunes TCP first; gke: xpk/GKE (default gce)
#   RTO_MIN=5ms        the TCP retransmission timeout rto_setup.sh sets with PLATFORM=gce (default 5ms)
#   EXECUTABLE=train|train_compile
#                      train (default), or AOT-compile the step for the recipe's TPU topology on
#                      any host (no TPU needed) and check that it fits in HBM
#   NUM_SLICES=n       slices to compile for with EXECUTABLE=train_compile (default 1; a training run
#                      warns that it does not read it: it uses the slices it is started on)
#   DRY_RUN=1          print the environment and the commands instead of running them
#   PYTHON=path        interpreter (default .venv/bin/python when present, else python3; a leading ~ is
#                      the home folder, also when zsh passed it unexpanded)
# The command runs in the repository's folder, wherever the recipe is started from: relative paths
# (OUTPUT_PATH, DATASET_PATH, PYTHON, path keys such as load_parameters_path) are taken from there.
#
# Compiler flags and variables of your own win over the recipe's: XLA_FLAGS and LIBTPU_INIT_ARGS,
# from the environment or as arguments (XLA_FLAGS=--xla_gpu_enable_command_buffer=), go after the
# recipe's flags (the last of a repeated flag is the one used), and an XLA_*, JAX_*, TPU_*, NCCL_*
# or CUDA_* variable given as an argument (NCCL_PROTO=SIMPLE) replaces the recipe's export.

RECIPE_PATH=${BASH_SOURCE[1]}
RECIPE_NAME=$(basename "$(dirname "$RECIPE_PATH")")_$(basename "${RECIPE_PATH%.sh}")
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RECIPE_OVERRIDES=()
RECIPE_VARIABLES=()  # NAME=value arguments for the environment: exported again in run_recipe, over the recipe's

for arg in "$@"; do
  if [ "$arg" = --help ] || [ "$arg" = -h ]; then  # the recipe's header, then the settings described above
    sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$RECIPE_PATH"
    sed -n '/^# Arguments are/,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
    exit 0
  fi
  name=${arg%%=*}
  if [[ "$arg" != *=* || ! "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]]; then
    echo "$RECIPE_PATH: argument '$arg' is not KEY=VALUE (e.g. RUN_NAME=my_run OUTPUT_PATH=gs://bucket/runs)" >&2
    exit 2
  fi
  if [[ "$name" =~ ^[a-z] ]]; then
    RECIPE_OVERRIDES+=("$arg")
    # the run name reaches train.py as M_RUN_NAME, which wins over a run_name=... argument: take it as RUN_NAME
    if [ "$name" = run_name ]; then export "RUN_NAME=${arg#*=}"; fi
  else
    case "$name" in  # a mistyped setting (OUTPUT_DIR, RUNNAME) was exported and ignored without a word
      M_RUN_NAME) echo "$RECIPE_PATH: warning: M_RUN_NAME is set from RUN_NAME (default $RECIPE_NAME); give" \
                       "RUN_NAME=${arg#*=} for that run name" >&2 ;;
      NUM_SLICES) NUM_SLICES_GIVEN=1 ;;
      RUN_NAME|OUTPUT_PATH|DATASET_PATH|PLATFORM|EXECUTABLE|NUM_SLICES|DRY_RUN|PYTHON|NNODES|NODE_RANK|RTO_MIN) ;;
      LIBTPU_INIT_ARGS|XLA_FLAGS) ;;
      XLA_*|JAX_*|TPU_*|NCCL_*|CUDA_*) RECIPE_VARIABLES+=("$arg") ;;
      TF_*|M_*|GOOGLE_*|GCS_*|HF_*|TESSERA_*|PYTHONPATH|PATH) ;;
      *) lower=$(printf '%s' "$name" | tr '[:upper:]' '[:lower:]')
         if grep -q "^$lower:" "$REPO_DIR/configs/base.yml"; then  # STEPS=20 was exported, and the run took 100 steps
           echo "$RECIPE_PATH: $name is not a recipe setting but a config key, which is lower case: give" \
                "$lower=${arg#*=} (an upper-case argument is only exported to the environment, which the run ignores)" >&2
           exit 2
         fi
         echo "$RECIPE_PATH: warning: $name is not a recipe setting (RUN_NAME, OUTPUT_PATH, DATASET_PATH, PLATFORM," \
              "EXECUTABLE, NUM_SLICES, DRY_RUN, PYTHON, NNODES, NODE_RANK, RTO_MIN) nor a JAX/XLA/TPU/NCCL variable; it is" \
              "only exported to the environment" >&2 ;;
    esac
    export "$arg"
  fi
done

CALLER_XLA_FLAGS=${XLA_FLAGS:-}  # the caller's flags (an argument replaces the environment's), before the recipe's
CALLER_NNODES=${NNODES:-}  # a GPU recipe exports its own VM count next
CALLER_LIBTPU_INIT_ARGS=${LIBTPU_INIT_ARGS:-}

case "${DRY_RUN:-0}" in  # true/yes used to run for real (route changes included): only 1/0 and their words
  1|true|yes|TRUE|True|YES|Yes) DRY_RUN=1 ;;
  0|false|no|FALSE|False|NO|No|"") DRY_RUN=0 ;;
  *) echo "$RECIPE_PATH: DRY_RUN=$DRY_RUN is not 1 or 0 (nor true, yes, false or no; DRY_RUN=1 prints the commands" \
          "instead of running them)" >&2
     exit 2 ;;
esac
export RUN_NAME=${RUN_NAME:-$RECIPE_NAME}
export M_RUN_NAME=$RUN_NAME
OUTPUT_PATH=${OUTPUT_PATH:-outputs}
PLATFORM=${PLATFORM:-gce}
EXECUTABLE=${EXECUTABLE:-train}
NUM_SLICES=${NUM_SLICES:-1}
case "$PLATFORM" in gce|gke) ;; *) echo "$RECIPE_PATH: PLATFORM=$PLATFORM is not gce or gke" >&2; exit 2 ;; esac
case "$EXECUTABLE" in train|train_compile) ;;
  *) echo "$RECIPE_PATH: EXECUTABLE=$EXECUTABLE is not train or train_compile" >&2; exit 2 ;;
esac
if [ "$EXECUTABLE" = train_compile ] && [ "$NUM_SLICES" != -1 ] && [[ ! "$NUM_SLICES" =~ ^0*[1-9][0-9]*$ ]]; then
  # train_compile's own error named compile_topology_num_slices, a key the caller never typed (-1: MaxText's 1)
  echo "$RECIPE_PATH: NUM_SLICES=$NUM_SLICES is not a number of slices; give 1 or more, e.g. NUM_SLICES=2" >&2
  exit 2
fi
if [ -n "${NUM_SLICES_GIVEN:-}" ] && [ "$EXECUTABLE" = train ]; then  # it was ignored without a word
  echo "$RECIPE_PATH: warning: NUM_SLICES=$NUM_SLICES is read with EXECUTABLE=train_compile only; a training run" \
       "uses the slices it is started on (multihost_runner.py's <prefix>-0, -1, ..., multihost_job.py --NUM_SLICES," \
       "xpk --num-slices)" >&2
fi
output=$OUTPUT_PATH  # base_output_directory=... as an argument comes after OUTPUT_PATH's: the last one is used
for arg in "${RECIPE_OVERRIDES[@]}"; do [[ "$arg" != base_output_directory=* ]] || output=${arg#*=}; done
if [ "$PLATFORM" = gke ] && [ "$EXECUTABLE" = train ] && [[ "$output" != *://* ]]; then
  # the default, outputs, is inside the container: the checkpoints went with the pod, and each worker kept its own
  echo "$RECIPE_PATH: warning: the run's folder $output is not a gs:// URL: with PLATFORM=gke a local folder is" \
       "inside the container, where checkpoints are lost when the pod ends and each worker keeps its own, unless" \
       "every worker mounts it as a shared volume; give OUTPUT_PATH=gs://<bucket>/<folder>" >&2
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO_DIR/.venv/bin/python" ]; then PYTHON=$REPO_DIR/.venv/bin/python; else PYTHON=python3; fi
fi
case "$PYTHON" in "~/"*) PYTHON=$HOME/${PYTHON#\~/} ;; esac  # as zsh (macOS's shell) passes PYTHON=~/... : unexpanded

# Print (DRY_RUN=1) or run one command.
recipe_exec() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "$@"
    echo
  else
    "$@"
  fi
}

# run_recipe <tpu topology or "gpu"> <key=value config overrides...>
run_recipe() {
  local topology=$1
  shift
  local overrides=("$@" "base_output_directory=$OUTPUT_PATH")
  if [ -n "${DATASET_PATH:-}" ]; then
    overrides+=("dataset_type=tfds")
    overrides+=("dataset_path=$DATASET_PATH")
  fi

  local cmd
  if [ "$EXECUTABLE" = train_compile ]; then
    if [ "$topology" = gpu ]; then
      echo "$RECIPE_PATH: EXECUTABLE=train_compile compiles for TPU topologies; GPU recipes run EXECUTABLE=train" >&2
      exit 2
    fi
    # the caller's overrides last, after the topology too: compile_topology=v5p-512 as an argument wins
    cmd=("$PYTHON" -m tessera.train_compile configs/base.yml "${overrides[@]}"
         "compile_topology=$topology" "compile_topology_num_slices=$NUM_SLICES" "${RECIPE_OVERRIDES[@]}")
  else
    cmd=("$PYTHON" train.py configs/base.yml "${overrides[@]}" "${RECIPE_OVERRIDES[@]}")
  fi

  if [ "$topology" = gpu ] && [ -n "$CALLER_NNODES" ] && [ "$CALLER_NNODES" != "${NNODES:-1}" ]; then
    # replaced without a word: each process then waited for NNODES=4 peers where 2 were started
    echo "$RECIPE_PATH: NNODES=$CALLER_NNODES, but this recipe is for NNODES=${NNODES:-1} VMs (its mesh and batch are" \
         "set for them): run it on ${NNODES:-1} VMs, or use a recipe for $CALLER_NNODES VMs (or leave NNODES out)" >&2
    exit 2
  fi
  if [ "$topology" = gpu ] && [ "${NNODES:-1}" -gt 1 ] && [ "${DRY_RUN:-0}" != 1 ]; then
    if [ -z "${JAX_COORDINATOR_IP:-}" ] || [ -z "${NODE_RANK:-}" ]; then
      echo "$RECIPE_PATH: this recipe spans NNODES=$NNODES VMs; run it on each VM with NODE_RANK=<0..$((NNODES - 1))>" \
           "and JAX_COORDINATOR_IP=<internal IP of the NODE_RANK=0 VM>" >&2
      exit 2
    fi
  fi
  local var words caller
  for var in "${RECIPE_VARIABLES[@]}"; do  # the caller's NCCL_PROTO=... wins over the recipe's export
    export "$var"
  done
  for var in LIBTPU_INIT_ARGS XLA_FLAGS; do  # one space between flags, however the recipe wrapped them
    caller=CALLER_$var
    if [ -n "${!caller}" ] && [ "${!var:-}" != "${!caller}" ]; then  # the recipe set its own: the caller's go last
      export "$var=${!var:-} ${!caller}"
    fi
    if [ -n "${!var:-}" ]; then
      read -r -d '' -a words <<<"${!var}" || true  # every line: flags on lines of their own were dropped
      export "$var=${words[*]}"
    fi
  done
  cd "$REPO_DIR"
  if [ "$DRY_RUN" != 1 ] && ! command -v "$PYTHON" >/dev/null 2>&1; then  # was bash's "No such file", exit 127
    echo "$RECIPE_PATH: PYTHON=$PYTHON is not a program here (a relative path is taken from $REPO_DIR); run" \
         "bash setup.sh for .venv/bin/python, or give PYTHON=<path of a Python with Tessera installed>" >&2
    exit 2
  fi
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "# dry run of $RECIPE_PATH: nothing is executed; the commands below run from $REPO_DIR with" \
         "PYTHONPATH=$REPO_DIR/src${PYTHONPATH:+:$PYTHONPATH}"
    local name
    for name in $(compgen -e | sort); do  # every family an argument may set (TPU_STDERR_LOG_LEVEL=0 was left out)
      if [[ "$name" =~ ^(LIBTPU_INIT_ARGS|XLA_.*|TPU_.*|NCCL_.*|CUDA_.*|JAX_.*|NNODES|NODE_RANK|M_.*)$ ]]; then
        printf 'export %s=%q\n' "$name" "${!name}"
      fi
    done
  fi
  if [ "$topology" != gpu ] && [ "$PLATFORM" = gce ] && [ "$EXECUTABLE" = train ]; then
    local rto_args=(${RTO_MIN:+"RTO_MIN=$RTO_MIN"})  # an argument: sudo resets the environment, RTO_MIN with it
    if [ "$(id -u)" = 0 ]; then
      recipe_exec bash rto_setup.sh "${rto_args[@]}"
    elif [ "$DRY_RUN" = 1 ] || command -v sudo >/dev/null 2>&1; then
      recipe_exec sudo bash rto_setup.sh "${rto_args[@]}"
    else
      echo "$RECIPE_PATH: on a TPU VM (PLATFORM=gce) the recipe first tunes the network with rto_setup.sh, which" \
           "needs root, and sudo is not installed: run the recipe as root, or with PLATFORM=gke (which skips it and" \
           "leaves the host network settings alone)" >&2
      exit 2
    fi
  fi
  export PYTHONPATH="$REPO_DIR/src${PYTHONPATH:+:$PYTHONPATH}"
  if [ "$DRY_RUN" = 1 ]; then
    recipe_exec "${cmd[@]}"
  else  # exec: a SIGTERM sent to the recipe (kill, a scheduler, GKE stopping the pod) reaches the program,
    exec "${cmd[@]}"  # which saves and exits 143; a bash parent waited, and the program ran on
  fi
}
