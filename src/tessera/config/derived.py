"""Values derived from the config and the mesh shape, computed once (`plan_run`).

The trainer and its parts read these from the `RunPlan` instead of deriving them again from
the root config: the global batch and its micro-batches, tokens per step, the schedule length,
whether dropout and document packing are on, and the run's output paths. Errors quote the
numbers that disagree and say which key to change. Model sizes scaled by
`global_parameter_scale` stay properties of `ModelConfig` (they depend on the model section only).
Nothing here imports JAX: the mesh arrives as its shape, {axis name: size}.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Mapping

from tessera.config.layers import LAYERS_PER_BLOCK, tail_layers
from tessera.config.schema import CheckpointConfig, Config, ConfigError, DataConfig, ModelConfig, RunConfig


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What one run derives from (config, mesh shape); built by `plan_run`."""

    num_devices: int  # devices in the mesh
    global_batch: int  # sequences per optimizer step, over all devices
    eval_batch: int  # sequences per evaluation batch, over all devices (0 without evaluation)
    micro_batches: int  # gradient_accumulation_steps: slices of the global batch run one after another
    max_target_length: int  # tokens per sequence T
    tokens_per_step: int  # global_batch * max_target_length
    schedule_steps: int  # length of the learning-rate schedule (learning_rate_schedule_steps, -1: steps)
    dropout_on: bool  # the train step draws dropout keys
    packed: bool  # rows may hold several documents (attention stays within segments)
    run_dir: Path  # base_output_directory/run_name: config.yml, metrics, report, profile (local, see run_dir())
    metrics_path: Path  # metrics_file, or run_dir/metrics.jsonl
    metrics_upload_dir: str  # gcs_metrics with a URL base: base_output_directory/run_name/metrics, else ""
    checkpoint_dir: str  # checkpoint_dir, or base_output_directory/run_name/checkpoints (URLs kept)
    pipeline: PipelineLayout | None = None  # stages, repeats, microbatches when the mesh has a stage axis


MAX_TOKENS_PER_STEP = 2**31 - 1  # JAX indexes with 32-bit integers (x64 off): positions in a step's tokens fit


def plan_run(cfg: Config, mesh_shape: Mapping[str, int]) -> RunPlan:
    """Every value that depends on the config and the mesh shape; ConfigError if they disagree."""
    batch = global_batch(cfg.data.per_device_batch_size, cfg.optim.gradient_accumulation_steps, mesh_shape)
    length = cfg.data.max_target_length
    _check_positions(cfg.model, length)
    _check_tokens(batch, length, "a global batch", "per_device_batch_size")
    pipeline = pipeline_layout(cfg, mesh_shape, batch // cfg.optim.gradient_accumulation_steps)
    evaluated = eval_batch(cfg, mesh_shape, pipeline)
    _check_tokens(evaluated, length, "an evaluation batch", "eval_per_device_batch_size")
    _check_eval_vocab_tiling(cfg, evaluated, length)
    return RunPlan(
        num_devices=math.prod(mesh_shape.values()), global_batch=batch, eval_batch=evaluated,
        micro_batches=cfg.optim.gradient_accumulation_steps, max_target_length=length,
        tokens_per_step=batch * length, schedule_steps=cfg.total_steps_in_schedule,
        dropout_on=dropout_rate(cfg.model) > 0, packed=packs_documents(cfg.data), run_dir=run_dir(cfg.run),
        metrics_path=Path(cfg.run.metrics_file) if cfg.run.metrics_file else run_dir(cfg.run) / "metrics.jsonl",
        metrics_upload_dir=f"{remote_run_dir(cfg.run)}/metrics" if cfg.run.gcs_metrics and remote_run_dir(cfg.run)
        else "",
        checkpoint_dir=checkpoint_directory(cfg.checkpoint, cfg.run.base_output_directory, cfg.run.run_name),
        pipeline=pipeline,
    )


def _check_positions(m: ModelConfig, length: int) -> None:
    """Training sequences must fit gpt3's learned position table (decoding checks its own lengths): the
    positions past it were gathered as NaN, and the loss was NaN at step 1."""
    table = m.trainable_position_size
    if m.decoder_block == "gpt3" and table and length > table:
        raise ConfigError(f"max_target_length={length} is longer than gpt3's learned position table "
                          f"(trainable_position_size={table} rows): positions from {table} on would have no "
                          "embedding and the loss would be NaN; raise trainable_position_size (MaxText's "
                          "gpt3-175b: 16384) or shorten max_target_length")


def _check_tokens(batch: int, length: int, what: str, key: str) -> None:
    """ConfigError past MAX_TOKENS_PER_STEP, naming the key to lower: max_target_length when one sequence is too
    long by itself (max_target_length=99999999999999 said "lower per_device_batch_size"), else `key`."""
    if batch * length > MAX_TOKENS_PER_STEP:
        fix = "max_target_length" if length > MAX_TOKENS_PER_STEP else key
        raise ConfigError(f"{what} of {batch:,} sequences of {length:,} tokens is {batch * length:,} tokens, more "
                          f"than the {MAX_TOKENS_PER_STEP:,} that 32-bit token indices reach (the largest trainings "
                          f"take about 16 million a step); lower {fix}")


def _check_eval_vocab_tiling(cfg: Config, batch: int, length: int) -> None:
    """num_vocab_tiling splits an evaluation batch's tokens into equal chunks too (`losses.token_chunks`);
    checks.py checks the training batch's, this the evaluation batch's, before anything is compiled (the
    eval step's compile raised it after the train step's, naming num_vocab_tiling alone)."""
    tiles, d = cfg.model.num_vocab_tiling, cfg.data
    if tiles > 1 and batch and (batch * length) % tiles:
        key = "eval_per_device_batch_size" if d.eval_per_device_batch_size else "per_device_batch_size"
        raise ConfigError(f"num_vocab_tiling={tiles} must divide the tokens of an evaluation batch: {batch} sequences "
                          f"({key}={d.eval_per_device_batch_size or d.per_device_batch_size:g} per device) x "
                          f"max_target_length={length} = {batch * length}; change eval_per_device_batch_size or "
                          "num_vocab_tiling")


def global_batch(per_device_batch_size: float, accumulation_steps: int, mesh_shape: Mapping[str, int],
                 key: str = "per_device_batch_size") -> int:
    """per_device_batch_size x devices, a whole number whose micro-batches split evenly over the
    batch axes (data, fsdp, expert) of the mesh. `key`: the key the value came from, for errors."""
    devices = math.prod(mesh_shape.values())
    exact = per_device_batch_size * devices
    if not math.isfinite(exact):  # 1e308 x 8 devices: int() raised OverflowError
        raise ConfigError(f"{key}={per_device_batch_size:g} x {devices} devices = {exact:g} sequences, more than the "
                          f"{MAX_TOKENS_PER_STEP:,} tokens that 32-bit token indices reach; lower {key}")
    batch = int(round(exact))
    if abs(exact - batch) > 1e-9 or batch < 1:
        raise ConfigError(
            f"{key}={per_device_batch_size:g} x {devices} devices = {exact:g} sequences; "
            "the global batch must be a whole number >= 1"
        )
    shards = mesh_shape["data"] * mesh_shape["fsdp"] * mesh_shape["expert"]
    if batch % accumulation_steps or (batch // accumulation_steps) % shards:
        what = f"the evaluation batch {batch}" if key.startswith("eval_") else f"global batch {batch}"
        if accumulation_steps == 1:
            raise ConfigError(f"{what} must be divisible by data*fsdp*expert={shards} (mesh {dict(mesh_shape)}); "
                              f"change {key} or the mesh")
        # name only the knobs that can work: fewer accumulation steps (1 at least) when the batch splits over
        # the batch axes; another mesh (1 batch shard at least) when the accumulation steps divide the batch
        fixes = [key] + ["gradient_accumulation_steps"] * (batch % shards == 0)
        fixes += ["the mesh"] * (shards > 1 and batch % accumulation_steps == 0)
        fix = f"change {', '.join(fixes[:-1])} or {fixes[-1]}" if len(fixes) > 1 else f"change {key}"
        if shards == 1:
            raise ConfigError(f"{what} is not a multiple of gradient_accumulation_steps={accumulation_steps} (each "
                              f"accumulation step takes an equal share of it); {fix}")
        raise ConfigError(
            f"{what} / gradient_accumulation_steps={accumulation_steps} must be a whole number divisible "
            f"by data*fsdp*expert={shards} (mesh {dict(mesh_shape)}), so a multiple of "
            f"{accumulation_steps * shards}; {fix}")
    return batch


def eval_batch(cfg: Config, mesh_shape: Mapping[str, int], pipeline: PipelineLayout | None) -> int:
    """Sequences in an evaluation batch (eval_per_device_batch_size, or per_device_batch_size, x
    devices); 0 without evaluation. The whole batch is one forward pass: with pipeline stages it is
    cut into their microbatches."""
    d = cfg.data
    if not d.eval_interval:
        return 0
    key = "eval_per_device_batch_size" if d.eval_per_device_batch_size else "per_device_batch_size"
    batch = global_batch(d.eval_per_device_batch_size or d.per_device_batch_size, 1, mesh_shape, key)
    shards = mesh_shape["data"] * mesh_shape["fsdp"] * mesh_shape["expert"]
    if pipeline and batch % (pipeline.microbatches * shards):
        raise ConfigError(f"the evaluation batch of {batch} sequences runs through the pipeline in its "
                          f"{pipeline.microbatches} microbatches, each split over data*fsdp*expert={shards} devices; "
                          f"set eval_per_device_batch_size so that the batch is a multiple of "
                          f"{pipeline.microbatches * shards}")
    return batch


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """How the decoder is pipelined over the `stage` mesh axis (see `tessera.models.pipeline`)."""

    stages: int  # S: ici_pipeline_parallelism x dcn_pipeline_parallelism
    repeats: int  # R: groups per stage (circular pipelining when > 1)
    blocks_per_stage: int  # blocks in one group (a block is LAYERS_PER_BLOCK layers)
    microbatches: int  # M: pieces of each (gradient-accumulation) batch
    microbatch_rows: int  # sequences in one microbatch
    hop: int = 1  # H: iterations from one stage to the next (2: pipeline_delay_activation_forwarding)
    gather_fsdp_once: bool = False  # pipeline_fsdp_ag_once: a stage's weights are gathered over fsdp before the loop

    @property
    def iterations(self) -> int:
        """Schedule length: every stage does M*R items, the last starts H*(S - 1) iterations late."""
        return self.microbatches * self.repeats + self.hop * (self.stages - 1)

    @property
    def bubble(self) -> float:
        """Fraction of the iterations a stage idles: H*(S - 1) / (M*R + H*(S - 1))."""
        return self.hop * (self.stages - 1) / self.iterations

    def describe(self, layers_per_block: int = 1) -> str:
        per_stage = self.blocks_per_stage * layers_per_block
        kind = f"circular, {self.repeats} repeats" if self.repeats > 1 else "GPipe"
        delayed = ", outputs handed on one iteration late" if self.hop > 1 else ""
        delayed += ", weights gathered over fsdp once per step" if self.gather_fsdp_once else ""
        formula = "(S-1)/(M*R+S-1)" if self.hop == 1 else f"{self.hop}(S-1)/(M*R+{self.hop}(S-1))"
        return (f"{self.stages} stages ({kind}{delayed}), {per_stage} layer(s) per stage group, {self.microbatches} "
                f"microbatches of {self.microbatch_rows} sequences; bubble {formula} = "
                f"{self.hop * (self.stages - 1)}/{self.iterations} = {100 * self.bubble:.1f}% of the iterations")


def _cut_block_message(what: str, layers: int, stages: int, repeats: int, per_stage: int, per_block: int,
                       block: str) -> str:
    """Why stage groups of `per_stage` layers cut the family's blocks of `per_block`, and the layouts that fit
    (there is one: the stage count divides the blocks, `_stages_do_not_divide_message` otherwise)."""
    blocks = layers // per_block
    fits = [f"num_pipeline_repeats={r} num_layers_per_pipeline_stage={layers // (stages * r)}"
            for r in range(1, blocks + 1) if blocks % (stages * r) == 0]
    return (f"{what} in {stages} pipeline stages x {repeats} repeats makes stage groups of {per_stage} layers, but a "
            f"group must hold whole blocks of {per_block} layers ({block}); set {' or '.join(fits[:3])}")


def _stages_do_not_divide_message(what: str, layers: int, stages: int, per_block: int, block: str) -> str:
    """Why `layers` cannot be split evenly over `stages`, whatever the repeats and group sizes."""
    if layers % per_block:
        return (f"{what} does not split into pipeline stages: every stage holds whole blocks of {per_block} layers "
                f"({block}), and {layers} is not a multiple of {per_block}; use a multiple of {per_block * stages} "
                "layers, or no pipeline stages")
    blocks = layers // per_block
    unit = f" blocks of {per_block} layers ({block})" if per_block > 1 else " layers"
    counts = ", ".join(str(d) for d in range(2, blocks + 1) if blocks % d == 0) or "none above 1"
    return (f"{what} cannot be split evenly over {stages} pipeline stages: every stage holds the same number of whole"
            f"{unit}, and {blocks} is not a multiple of {stages}; num_pipeline_repeats and "
            f"num_layers_per_pipeline_stage cannot change that. Use a stage count "
            f"(ici_pipeline_parallelism x dcn_pipeline_parallelism) that divides {blocks} ({counts}), or a layer count "
            f"that is a multiple of {stages * per_block}")


def _stage_groups(cfg: Config, stages: int) -> tuple[int, int, int]:
    """(repeats, layers per stage group, layers per block) of a pipeline of `stages` stages, with the
    -1 keys filled in; ConfigError when the layers do not split into stages x repeats groups of whole blocks."""
    mesh, m = cfg.mesh, cfg.model
    per_block = LAYERS_PER_BLOCK.get(m.decoder_block, 1)
    # deepseek's dense layers run below the pipeline, the local layers of gemma3 and olmo3 after their last whole
    # pattern (the decoder's tail) above it; only the layers between are split over stages
    dense = m.first_num_dense_layers if m.decoder_block == "deepseek" else 0
    tail = tail_layers(m)
    layers, repeats, per_stage = (m.num_decoder_layers - dense - tail, mesh.num_pipeline_repeats,
                                  mesh.num_layers_per_pipeline_stage)
    if repeats == -1 and per_stage == -1:
        repeats = 1
    if repeats == -1:
        repeats = max(1, layers // (stages * per_stage))
    if per_stage == -1:
        per_stage = max(1, layers // (stages * repeats))
    # the key the user sets: base_num_decoder_layers (num_decoder_layers is no key), scaled by global_parameter_scale
    count = f"base_num_decoder_layers={m.base_num_decoder_layers}" if m.num_decoder_layers == m.base_num_decoder_layers \
        else (f"{m.num_decoder_layers} decoder layers (base_num_decoder_layers={m.base_num_decoder_layers} scaled by "
              f"global_parameter_scale={m.global_parameter_scale})")
    what = count
    if dense:
        what = f"the {layers} expert layers ({count} less first_num_dense_layers={dense}, which run before the pipeline)"
    if tail:
        what = (f"the {layers} layers of whole patterns ({count} less the {tail} local layers after the last whole "
                "pattern, which run after the pipeline)")
    if (layers // per_block) % stages or layers % per_block:  # no repeats / group size can help
        raise ConfigError(_stages_do_not_divide_message(what, layers, stages, per_block, m.decoder_block))
    if stages * repeats * per_stage != layers:
        unit = f" and a stage group must hold whole blocks of {per_block} layers ({m.decoder_block})" \
            if per_block > 1 else ""
        raise ConfigError(
            f"{what} must equal pipeline stages {stages} x num_pipeline_repeats {repeats} x "
            f"num_layers_per_pipeline_stage {per_stage} = {stages * repeats * per_stage}{unit}; change "
            "num_pipeline_repeats / num_layers_per_pipeline_stage (or the stage count)")
    if per_stage % per_block:  # the product is right, but a group would cut a block (gemma2's local/global pair)
        raise ConfigError(_cut_block_message(what, layers, stages, repeats, per_stage, per_block, m.decoder_block))
    return repeats, per_stage, per_block


def pipeline_layout(cfg: Config, mesh_shape: Mapping[str, int], rows: int) -> PipelineLayout | None:
    """The pipeline of a mesh with a stage axis (None without one), for batches of `rows`
    sequences (the global batch over gradient_accumulation_steps). ConfigError when the layers
    do not split into stages x repeats groups or the batch not into microbatches."""
    stages, mesh = mesh_shape.get("stage", 1), cfg.mesh
    if stages == 1:
        if mesh.pipeline_fsdp_ag_once:
            raise ConfigError("pipeline_fsdp_ag_once=true gathers a pipeline stage's fsdp-split weights once per step, "
                              "and this mesh has no pipeline stages; set ici_pipeline_parallelism or "
                              "dcn_pipeline_parallelism above 1, or drop the key")
        return None
    repeats, per_stage, per_block = _stage_groups(cfg, stages)
    shards = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1) * mesh_shape.get("expert", 1)
    micro, hop = mesh.num_pipeline_microbatches, 2 if mesh.pipeline_delay_activation_forwarding else 1
    # a circular pipeline's output comes back to stage 0 H*S iterations after it left: M >= H*S
    least = hop * stages if repeats > 1 else stages
    if micro == -1:
        fits = [k * stages for k in (4, 2, 1) if rows % (k * stages * shards) == 0 and k * stages >= least]
        if not fits:
            raise ConfigError(
                f"{_pipelined_rows(cfg, rows)} cannot be cut into {least} pipeline microbatches ("
                f"{'two' if least > stages else 'one'} per stage at least) that each split over data*fsdp*expert="
                f"{shards} devices; {_pipeline_fixes(cfg, rows, least, shards, least)}")
        micro = fits[0]
    if micro < stages:
        raise ConfigError(f"num_pipeline_microbatches={micro} is fewer than the {stages} pipeline stages: every stage "
                          f"needs a microbatch of its own; use at least {stages}")
    if micro < least:
        raise ConfigError(
            f"num_pipeline_microbatches={micro} is fewer than 2 x {stages} stages, which a circular pipeline with "
            f"pipeline_delay_activation_forwarding needs (a microbatch's output comes back to the first stage "
            f"{least} iterations after it left); use at least {least} microbatches or turn the delay off")
    if rows % micro or (rows // micro) % shards:
        raise ConfigError(
            f"{_pipelined_rows(cfg, rows)} cannot be cut into num_pipeline_microbatches={micro} microbatches that "
            f"each split over data*fsdp*expert={shards} devices ({rows} must be a multiple of {micro * shards}); "
            f"{_pipeline_fixes(cfg, rows, micro, shards, least)}")
    return PipelineLayout(stages, repeats, per_stage // per_block, micro, rows // micro, hop,
                          mesh.pipeline_fsdp_ag_once)


def _pipelined_rows(cfg: Config, rows: int) -> str:
    """The batch a pipeline cuts into microbatches, for errors: with gradient accumulation, one micro-batch."""
    steps = cfg.optim.gradient_accumulation_steps
    if steps == 1:
        return f"the batch of {rows} sequences"
    return (f"the accumulation micro-batch of {rows} sequences (global batch {rows * steps} / "
            f"gradient_accumulation_steps={steps})")


def _pipeline_fixes(cfg: Config, rows: int, micro: int, shards: int, least: int) -> str:
    """The keys that can make `rows` (one micro-batch) split into `micro` pipeline microbatches of whole shards:
    a larger batch always; fewer accumulation steps when the global batch splits so; another
    num_pipeline_microbatches when one of at least `least` does."""
    steps = cfg.optim.gradient_accumulation_steps
    fixes = [f"raise per_device_batch_size so the {'global ' if steps > 1 else ''}batch is a multiple of "
             f"{steps * micro * shards}"]
    if steps > 1 and (rows * steps) % (micro * shards) == 0:
        fixes.append(f"lower gradient_accumulation_steps so each micro-batch is a multiple of {micro * shards}")
    if rows % shards == 0 and rows // shards >= least and rows // shards != micro:
        fixes.append(f"set num_pipeline_microbatches={rows // shards}")
    return ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1]


def dropout_rate(cfg: ModelConfig) -> float:
    """The dropout rate in effect: dropout_rate with enable_dropout=true, else 0."""
    return cfg.dropout_rate if cfg.enable_dropout else 0.0


def packs_documents(cfg: DataConfig) -> bool:
    """Whether rows may hold several documents (the model must then attend within segments only)."""
    return cfg.packing and cfg.dataset_type != "synthetic"


def run_dir(cfg: RunConfig) -> Path:
    """base_output_directory/run_name: the local folder where a run (or an AOT compile) writes
    its files. With a URL base (gs://...) only checkpoints (and, with gcs_metrics, the metrics)
    go there; the other files stay local, in outputs/run_name under the working directory."""
    if remote_run_dir(cfg):
        return Path.cwd() / "outputs" / cfg.run_name
    return Path(cfg.base_output_directory) / cfg.run_name


def remote_run_dir(cfg: RunConfig) -> str:
    """base_output_directory/run_name when the base is a URL (gs://bucket/runs), else ""."""
    base = cfg.base_output_directory
    return f"{base.rstrip('/')}/{_name_path(cfg.run_name)}" if "://" in base else ""


def checkpoint_directory(cfg: CheckpointConfig, base_output_directory: str, run_name: str) -> str:
    """`checkpoint_dir`, or base_output_directory/run_name/checkpoints; `gs://` paths stay URLs."""
    if cfg.checkpoint_dir:
        return cfg.checkpoint_dir
    return f"{base_output_directory.rstrip('/')}/{_name_path(run_name)}/checkpoints"


def _name_path(run_name: str) -> str:
    """run_name without a trailing or doubled '/' (`sweep1/`, `a//b`), as a local path reads it: in a bucket,
    gs://b/runs/sweep1//checkpoints is another folder than gs://b/runs/sweep1/checkpoints."""
    return "/".join(part for part in run_name.split("/") if part)
