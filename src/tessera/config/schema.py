"""The typed schema behind Tessera's flat config keys.

Every public key lives in exactly one section dataclass, with its type, its default and a
one-line comment (units included): the model's architecture in `model_schema.py`, the other
sections below (`key` and the allowed values are in `fields.py`). `configs/base.yml` is
generated from them (`.venv/bin/python -m tessera.config > configs/base.yml`) and a test keeps
the two equal, so the documentation of a key and its behaviour cannot drift apart.

Keys that hold local paths carry `path=` (see `fields.PATH_KINDS`): the loader makes them absolute
against the working directory when it builds the config, so nothing past the config ever sees
a relative path (Orbax refuses them) and the run writes where the command was typed.

Each component receives only its own section (`ModelConfig`, `MeshConfig`, ...); the root
`Config` groups them and holds the values derived from several sections.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tessera.config.fields import (DATASET_TYPES, LR_SCHEDULES, MAX_DATA_WORKERS, MAX_STEPS, MU_DTYPES, OPTIMIZERS,
                                   PROFILERS, TOKENIZER_TYPES, WSD_DECAY_STYLES, key)
from tessera.config.model_schema import ModelConfig


@dataclass
class RunConfig:
    """Where a run writes and how long it lasts."""

    run_name: str = key("", "name of the run; outputs go to base_output_directory/run_name (empty: a timestamped name)")
    base_output_directory: str = key("outputs", "root folder for all runs (local path or gs://bucket/path)",
                                     path="path")
    steps: int = key(150, "number of optimizer steps to train", minimum=1, maximum=MAX_STEPS)
    log_period: int = key(1, "print one metrics line every this many steps (and the first step a start trains, and the last)", minimum=1)
    metrics_file: str = key("", "JSONL file of per-step metrics (empty: base_output_directory/run_name/metrics.jsonl)",
                            path="path")
    enable_tensorboard: bool = key(True, "write TensorBoard event files under base_output_directory/run_name/tensorboard")
    gcs_metrics: bool = key(False, "with a gs:// base_output_directory: also write the metrics there, as "
                            "run_name/metrics/metrics_<first>_<last>.jsonl files (the local copy stays)")
    init_weights_seed: int = key(0, "PRNG seed for parameter initialization and dropout (all 64 bits count)")
    jax_cache_dir: str = key("", "JAX's persistent compilation cache (local folder or gs://): a later run of the "
                             "same step loads it instead of compiling again (empty: off, unless "
                             "JAX_COMPILATION_CACHE_DIR is set)", path="path")
    report_warmup_steps: int = key(3, "steps left out of the run report's medians (compilation and warm-up)", minimum=0)
    step_timeout_seconds: float = key(1800.0, "hang watchdog: dump stacks and exit (code 5) when no step (nor eval "
                                      "batch) finishes within this many seconds (0: off); a checkpoint save that "
                                      "blocks the loop gets its bytes at 20 MB/s more", minimum=0.0)
    on_nonfinite_loss: str = key("stop", "a NaN/inf loss or gradient: 'stop' the run, or 'skip_step' (drop that update)",
                                 ("stop", "skip_step"))


@dataclass
class ProfilerConfig:
    """Trace capture and the compiler's HLO dump."""

    profiler: str = key("", "'' (off) or 'xplane' (JAX profiler trace, viewable in TensorBoard/Perfetto)", PROFILERS)
    skip_first_n_steps_for_profiler: int = key(1, "steps to run before the trace starts (skips compilation)", minimum=0)
    profiler_steps: int = key(5, "number of steps captured in the trace", minimum=1)
    dump_hlo: bool = key(False, "write XLA's dump of the compiled programs (HLO before and after optimization, buffer "
                                "assignment) as they compile; train.py and train_compile")
    dump_hlo_local_dir: str = key("", "folder of the HLO dump ('': the run folder's xla_dump/)", path="path")
    dump_hlo_module_name: str = key("jit_train_step", "dump only programs whose name matches this regular expression "
                                    "(jit_train_step: the train step; '': every program)")
    dump_hlo_xla_flags: str = key("", "XLA flags used instead of the dump flags dump_hlo sets (--xla_dump_to=<folder> "
                                      "--xla_dump_hlo_module_re=<name>), added to XLA_FLAGS")


@dataclass
class MeshConfig:
    """Device mesh. ici_* axes run inside a slice, dcn_* across slices; one of each may be -1."""

    ici_data_parallelism: int = key(1, "data-parallel ways inside a slice (-1: fill from device count)")
    ici_fsdp_parallelism: int = key(-1, "fully-sharded data-parallel ways inside a slice (-1: fill)")
    ici_sequence_parallelism: int = key(1, "sequence (context) parallel ways inside a slice (-1: fill)")
    ici_tensor_parallelism: int = key(1, "tensor (model) parallel ways inside a slice (-1: fill)")
    ici_fsdp_transpose_parallelism: int = key(1, "MaxText's second fsdp axis; Tessera folds it into the fsdp axis "
                                              "(fsdp ways = ici_fsdp x this; -1: fill)")
    ici_expert_parallelism: int = key(1, "expert-parallel ways inside a slice (-1: fill)")
    ici_pipeline_parallelism: int = key(1, "pipeline stages inside a slice (the decoder's layers are split over "
                                        "them; see num_pipeline_microbatches)")
    dcn_data_parallelism: int = key(-1, "data-parallel ways across slices (-1: fill from slice count)")
    dcn_fsdp_parallelism: int = key(1, "fsdp ways across slices")
    dcn_sequence_parallelism: int = key(1, "sequence-parallel ways across slices")
    dcn_tensor_parallelism: int = key(1, "tensor-parallel ways across slices")
    dcn_fsdp_transpose_parallelism: int = key(1, "as ici_fsdp_transpose_parallelism, across slices (folded into fsdp)")
    dcn_expert_parallelism: int = key(1, "expert-parallel ways across slices")
    dcn_pipeline_parallelism: int = key(1, "pipeline stages across slices (stages = ici x dcn pipeline parallelism)")
    num_pipeline_microbatches: int = key(
        -1, "microbatches the batch is cut into when pipelining, at least the stage count (-1: 4, 2 or 1 times the "
        "stages, the first that leaves each microbatch divisible over the batch axes)")
    num_pipeline_repeats: int = key(
        -1, "circular pipelining: times a microbatch goes round the stages, each stage holding this many "
        "non-adjacent groups of layers (-1: from num_layers_per_pipeline_stage, else 1, plain GPipe)")
    num_layers_per_pipeline_stage: int = key(
        -1, "decoder layers in one group of a stage; layers = stages x repeats x this (-1: from num_pipeline_repeats)")
    pipeline_delay_activation_forwarding: bool = key(
        False, "hand each stage's output on one iteration late, so the transfer overlaps the next iteration's "
        "compute instead of stalling it (worth it when it is slow, across slices); costs S - 1 more iterations "
        "of bubble, and a circular pipeline needs at least 2 x stages microbatches")
    pipeline_fsdp_ag_once: bool = key(
        False, "gather each stage's fsdp-split weights once per step, before the pipeline's iterations, instead of "
        "in every iteration: fewer, larger all-gathers for the memory of the stage's whole weights on every device")
    num_slices: int = key(-1, "number of slices (-1: detect from the devices)", minimum=-1)
    param_replication_warn_mib: float = key(
        1.0, "report parameters larger than this (MiB) that end up fully replicated on a sharded mesh", minimum=0.0
    )


@dataclass
class DataConfig:
    """Input pipeline."""

    dataset_type: str = key("synthetic", "input pipeline", DATASET_TYPES)
    per_device_batch_size: float = key(8.0, "sequences per device per step (global batch = this x device count)")
    max_target_length: int = key(128, "tokens per training sequence T", minimum=2)
    reuse_example_batch: bool = key(False, "feed the first batch at every step (for speed tests)")
    data_shuffle_seed: int = key(0, "seed of the synthetic token stream and of the grain/tfds record order "
                                 "(grain's shuffle takes 32 bits)", minimum=0, maximum=2**32 - 1)
    hf_path: str = key("", "dataset_type=hf: a file format (parquet, json, arrow, text, csv), a local dataset "
                       "directory, or a Hugging Face Hub dataset name (taken as local, and resolved, when it exists "
                       "or starts with /, ./, ../ or ~)", path="local_or_name")
    hf_train_files: str = key("", "training files for hf_path=<format>: comma-separated globs, e.g. /data/c4/000*.parquet",
                              path="globs")
    hf_eval_files: str = key("", "evaluation files, as hf_train_files (empty: no eval data)", path="globs")
    hf_streaming: bool = key(True, "stream files instead of converting them to an Arrow cache first (large corpora)")
    train_split: str = key("train", "split read for training from a dataset directory, Hub dataset or TFDS dataset")
    eval_split: str = key("validation", "split read for evaluation from a dataset directory, Hub dataset or TFDS "
                          "dataset")
    dataset_name: str = key("", "dataset_type=tfds: the TFDS dataset as name/config:version, e.g. c4/en:3.1.0 "
                            "(prepared in ArrayRecord format)")
    dataset_path: str = key("", "dataset_type=tfds: the TFDS data directory holding dataset_name (local or gs://; "
                            "empty: TFDS's default, ~/tensorflow_datasets)", path="path")
    eval_dataset_name: str = key("", "dataset_type=tfds: the TFDS dataset for evaluation (empty: dataset_name)")
    train_data_columns: list = key(["text"], "text columns, joined with a newline (a list-of-ints column is "
                                   "taken as already tokenized)")
    grain_train_files: str = key("", "dataset_type=grain: comma-separated globs of ArrayRecord or Parquet files",
                                  path="globs")
    grain_eval_files: str = key("", "evaluation files for dataset_type=grain, as grain_train_files", path="globs")
    grain_file_type: str = key("arrayrecord", "format of the grain files (ArrayRecord records: UTF-8 text or a JSON "
                               "object holding train_data_columns)", ("arrayrecord", "parquet"))
    grain_worker_count: int = key(0, "grain and tfds: processes that read and tokenize records (0: in the training "
                                  "process)",
                                  minimum=0, maximum=MAX_DATA_WORKERS)
    tokenizer_path: str = key("", "SentencePiece .model, tiktoken BPE file, or a folder/file with tokenizer.json",
                               path="path")
    tokenizer_type: str = key("auto", "tokenizer kind when the path does not make it clear", TOKENIZER_TYPES)
    add_bos: bool = key(True, "start every document with the tokenizer's begin-of-sequence token")
    add_eos: bool = key(True, "end every document with the tokenizer's end-of-sequence token")
    packing: bool = key(True, "pack several documents into each sequence (segment ids keep attention and loss "
                        "inside a document); false: one document piece per sequence, padding masked")
    eval_interval: int = key(0, "evaluate every this many steps, and at the last step (0: never)", minimum=0)
    eval_steps: int = key(-1, "batches per evaluation (-1: until the eval data ends)")
    eval_per_device_batch_size: float = key(0.0, "sequences per device in an evaluation batch (0: "
                                            "per_device_batch_size; an evaluation keeps no activations for a "
                                            "backward pass, so it may take more)", minimum=0.0)
    target_eval_loss: float = key(0.0, "stop after the first evaluation whose eval_loss is at or below this, "
                                  "saving a checkpoint there (0: train all `steps`)", minimum=0.0)


@dataclass
class OptimConfig:
    """The optimizer (AdamW, SGD or Muon), warm-up + cosine or WSD schedule, clipping and gradient accumulation."""

    opt_type: str = key("adamw", "optimizer: adamw; sgd (plain, no momentum or weight decay); muon (the blocks' "
                        "weight matrices by orthogonalized momentum, embeddings, output layer, norms and biases by "
                        "AdamW)", choices=OPTIMIZERS)
    learning_rate: float = key(3e-3, "peak learning rate", minimum=0.0)
    warmup_steps_fraction: float = key(0.1, "fraction of learning_rate_schedule_steps spent warming up linearly",
                                         minimum=0.0, maximum=1.0)
    learning_rate_schedule_steps: int = key(-1, "length of the schedule in steps (-1: steps)", maximum=MAX_STEPS)
    lr_schedule_type: str = key("cosine", "the schedule after the warm-up: cosine (decay from the peak over the rest "
                                "of the schedule) or wsd (warm-up, stable, decay: the peak held, then a decay over its "
                                "last wsd_decay_steps_fraction)", choices=LR_SCHEDULES)
    cosine_learning_rate_final_fraction: float = key(0.1, "final learning rate as a fraction of the peak, where either "
                                                     "schedule ends (MaxText's newer name, learning_rate_final_fraction, "
                                                     "is read as this key)", minimum=0.0, maximum=1.0)
    wsd_decay_steps_fraction: float = key(0.1, "wsd: fraction of learning_rate_schedule_steps spent decaying, at its "
                                          "end (0: the peak to the end)", minimum=0.0, maximum=1.0)
    wsd_decay_style: str = key("linear", "wsd: the decay's shape, linear or cosine", choices=WSD_DECAY_STYLES)
    adam_b1: float = key(0.9, "AdamW beta1", minimum=0.0)
    adam_b2: float = key(0.95, "AdamW beta2", minimum=0.0)
    adam_eps: float = key(1e-8, "AdamW epsilon", minimum=0.0)
    adam_eps_root: float = key(0.0, "AdamW epsilon inside the square root of its denominator, sqrt(v + adam_eps_root) + "
                               "adam_eps (MaxText's key)", minimum=0.0)
    mu_dtype: str = key("", "dtype of AdamW's first moment and Muon's momentum: '' the parameters' (weight_dtype); "
                        "bfloat16 halves it (MaxText's large recipes), the second moment stays as the parameters",
                        choices=MU_DTYPES)
    optimizer_memory_host_offload: bool = key(
        False, "keep AdamW's moments in the host's pinned memory between steps; the update streams them through the "
        "devices one layer of the scanned stack at a time (MaxText's key): the forward and backward passes run "
        "without them in device memory, for the time of their transfers; needs opt_type=adamw, scan_layers=true, "
        "no pipeline stages")
    grad_dtype: str = key("", "dtype float32 gradients are rounded to before clipping and the update: bfloat16 "
                          "halves the gradients the update reads (their reductions run in the compute dtype "
                          "already); '' or float32 (MaxText's default) keeps the parameters' dtype", choices=MU_DTYPES)
    adam_weight_decay: float = key(0.1, "AdamW decoupled weight decay, times the learning rate; every parameter AdamW "
                                   "trains decays but the norms' scales and DeepSeek's routing biases", minimum=0.0)
    adamw_mask: list = key([], "regular expressions (searched in Tessera's parameter paths, e.g. layers/attention/wq_dnh, "
                           "token_embedder/table_vd) of parameters AdamW does not decay, beside the norm scales and "
                           "routing biases it never decays (MaxText's key); each must match a parameter")
    trainable_parameters_mask: list = key([], "regular expressions (searched in Tessera's parameter paths) of the only "
                                          "parameters that train: the others keep their values and have no "
                                          "optimizer state, and their gradients are not computed (MaxText's key; "
                                          "[]: all train)")
    muon_beta: float = key(0.95, "muon: decay of the momentum the update orthogonalizes", minimum=0.0)
    muon_weight_decay: float = key(0.0, "muon: weight decay of the Muon-trained matrices, times the learning rate",
                                   minimum=0.0)
    muon_consistent_rms: float = key(0.0, "muon: 0 scales each orthogonalized update by sqrt(max(1, fan_out / "
                                     "fan_in)); > 0 by sqrt(max(fan_in, fan_out)) x this, an RMS like AdamW's at 0.2",
                                     minimum=0.0)
    gradient_clipping_threshold: float = key(1.0, "clip gradients to this global norm (0: no clipping)", minimum=0.0)
    skip_step_on_spikes: bool = key(False, "drop the update of a step whose loss or gradient norm (before clipping) "
                                    "is more than skip_step_scaling_factor standard deviations above its mean over "
                                    "the last skip_step_interval steps (OLMo-core's and MaxText's rule; the window is "
                                    "saved with the train state)")
    skip_step_interval: int = key(128, "skip_step_on_spikes: steps in the window of recent losses and gradient norms; "
                                  "no step is skipped before it holds max(2, skip_step_interval // 2)", minimum=2,
                                  maximum=1 << 20)
    skip_step_scaling_factor: float = key(6.0, "skip_step_on_spikes: standard deviations above the window's mean that "
                                          "make a spike", minimum=0.0)
    gradient_accumulation_steps: int = key(1, "micro-batches accumulated per optimizer step", minimum=1)
    shard_optimizer_over_data: bool = key(False, "ZeRO-1: split the optimizer state over the data axis as well "
                                          "(parameters stay replicated there); less state memory per device")


@dataclass
class CheckpointConfig:
    """Orbax checkpoints: periodic saves, automatic resume, parameter-only and full-state loads."""

    enable_checkpointing: bool = key(True, "save checkpoints and resume from the newest one in checkpoint_dir")
    async_checkpointing: bool = key(True, "write checkpoints in the background (the step only waits for the copy to host)")
    checkpoint_period: int = key(100, "save every this many steps (the last step and a SIGTERM also save)", minimum=1)
    max_num_checkpoints_to_keep: int = key(-1, "keep only the newest N complete checkpoints (-1: keep all)")
    checkpoint_checksums: bool = key(True, "record a CRC32C of every checkpoint file at save and verify them before "
                                      "loading (local folders; a bucket checks its own)")
    checkpoint_dir: str = key("", "where checkpoints go (empty: base_output_directory/run_name/checkpoints)",
                               path="path")
    load_parameters_path: str = key("", "start from these parameters only (a checkpoint step folder or a params "
                                     "checkpoint)", path="path")
    checkpoint_is_quantized: bool = key(False, "decoding: load_parameters_path holds weights in quantized form "
                                        "(written by decode.py save_quantized_params_path=...)")
    save_quantized_params_path: str = key("", "decoding: also write the loaded weights quantized (as `quantization` "
                                          "says: int8 or float8) to this folder", path="path")
    load_full_state_path: str = key("", "start from this full state: parameters, optimizer state and step "
                                     "(a checkpoint step folder)", path="path")


@dataclass
class CompileConfig:
    """Ahead-of-time compilation of the train step for a TPU topology on any host (train_compile)."""

    compile_topology: str = key("", "TPU slice to AOT-compile for, e.g. v5p-256, v5e-256, v6e-256, v4-128 ('': none)")
    compile_topology_num_slices: int = key(1, "number of such slices joined over DCN (data center network); at most "
                                           "511, libtpu's limit (it aborts at 512)", minimum=1, maximum=511)
    compile_hbm_budget_fraction: float = key(
        0.95, "share of a chip's HBM the compiled step may use; the rest is left to the TPU runtime", minimum=0.0
    )
    compiled_trainstep_file: str = key("", "train_compile: also save the compiled step to this file (pickled "
                                       "jax serialize_executable payload, as MaxText); train.py compiles its own",
                                       path="path")


OPTIMIZATION_LEVELS = ("", "O0", "O1")


@dataclass
class GpuConfig:
    """GPU compiler and memory settings, set before JAX starts (gpu_tuning.py); the defaults change nothing."""

    optimization_level: str = key("", "JAX's optimization level (JAX_OPTIMIZATION_LEVEL); O1 turns on XLA's GPU bundle: "
                                  "latency-hiding scheduler, pipelined collectives, loop double buffering "
                                  "('': JAX's default)", OPTIMIZATION_LEVELS)
    enable_pgle: bool = key(False, "JAX's automatic profile-guided latency estimator: profile the first "
                            "pgle_profiling_runs calls of each jitted function, then recompile it with the measured "
                            "times (not the AOT-compiled train step: use pgle_profile_path)")
    pgle_profiling_runs: int = key(3, "enable_pgle: calls profiled before the recompile", minimum=1)
    pgle_profile_path: str = key("", "PGLE profile from an earlier run (.pb/.pbtxt file, or a folder of "
                                 "<fingerprint>.pb), passed to XLA as --xla_gpu_pgle_profile_file_or_directory_path",
                                 path="path")
    xla_python_client_mem_fraction: float = key(0.0, "share of each GPU's memory JAX takes at start-up, in (0, 1] "
                                                "(sets XLA_PYTHON_CLIENT_MEM_FRACTION; 0: leave it, JAX's default "
                                                "is 0.75)", minimum=0.0)

    def __post_init__(self):
        from tessera.gpu_tuning import check_gpu_config  # checks that choices/minimum cannot express

        check_gpu_config(self)


class ConfigError(ValueError):
    """A user error in the config: the message says which key, which value, and what to do."""


@dataclass
class Config:
    """The whole config, one attribute per section. Components receive only their section."""

    run: RunConfig = field(default_factory=RunConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)

    @property
    def total_steps_in_schedule(self) -> int:
        s = self.optim.learning_rate_schedule_steps
        return self.run.steps if s == -1 else s


SECTIONS = {
    "run": RunConfig,
    "profiler": ProfilerConfig,
    "model": ModelConfig,
    "mesh": MeshConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "compile": CompileConfig,
    "gpu": GpuConfig,
}


def path_keys() -> dict[str, str]:
    """Flat key -> path kind (PATH_KINDS), for every key that holds local paths."""
    return {name: f.metadata["path"] for name, (_, f) in all_fields().items() if f.metadata["path"]}


def all_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Flat key -> (section name, dataclass field), for every public key."""
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            out[f.name] = (section, f)
    return out


def render_base_yml() -> str:
    """The text of configs/base.yml: every key, its default and its comment, by section."""
    import json

    lines = [
        "# Tessera base config: every key with its default. Generated from",
        "# src/tessera/config/schema.py and model_schema.py; regenerate with",
        "#   .venv/bin/python -m tessera.config > configs/base.yml",
        "# Precedence: this file < configs/models/<model_name>.yml < key=value < M_<KEY> env vars.",
        "# Keys marked [path] take local paths or URLs (gs://...). A relative path is resolved against the",
        "# working directory when the config is loaded (outputs -> $PWD/outputs); URLs are kept as they are.",
    ]
    for section, cls in SECTIONS.items():
        lines += ["", f"# --- {section}: {cls.__doc__.strip()}"]
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            value = json.dumps(default)  # JSON scalars and lists are valid YAML
            choices = f.metadata["choices"]
            extra = f" [one of: {', '.join(repr(c) for c in choices)}]" if choices else ""
            extra += " [path]" if f.metadata["path"] else ""
            lines.append(f"{f.name}: {value}  # {f.metadata['doc']}{extra}")
    from tessera.config.maxtext import render_aliases

    return "\n".join(lines + render_aliases()) + "\n"
