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

from tessera.config.schema import CheckpointConfig, Config, ConfigError, DataConfig, ModelConfig, RunConfig


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What one run derives from (config, mesh shape); built by `plan_run`."""

    num_devices: int  # devices in the mesh
    global_batch: int  # sequences per optimizer step, over all devices
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


def plan_run(cfg: Config, mesh_shape: Mapping[str, int]) -> RunPlan:
    """Every value that depends on the config and the mesh shape; ConfigError if they disagree."""
    batch = global_batch(cfg.data.per_device_batch_size, cfg.optim.gradient_accumulation_steps, mesh_shape)
    length = cfg.data.max_target_length
    return RunPlan(
        num_devices=math.prod(mesh_shape.values()), global_batch=batch,
        micro_batches=cfg.optim.gradient_accumulation_steps, max_target_length=length,
        tokens_per_step=batch * length, schedule_steps=cfg.total_steps_in_schedule,
        dropout_on=dropout_rate(cfg.model) > 0, packed=packs_documents(cfg.data), run_dir=run_dir(cfg.run),
        metrics_path=Path(cfg.run.metrics_file) if cfg.run.metrics_file else run_dir(cfg.run) / "metrics.jsonl",
        metrics_upload_dir=f"{remote_run_dir(cfg.run)}/metrics" if cfg.run.gcs_metrics and remote_run_dir(cfg.run)
        else "",
        checkpoint_dir=checkpoint_directory(cfg.checkpoint, cfg.run.base_output_directory, cfg.run.run_name),
    )


def global_batch(per_device_batch_size: float, accumulation_steps: int, mesh_shape: Mapping[str, int]) -> int:
    """per_device_batch_size x devices, a whole number whose micro-batches split evenly over the
    batch axes (data, fsdp, expert) of the mesh."""
    devices = math.prod(mesh_shape.values())
    exact = per_device_batch_size * devices
    batch = int(round(exact))
    if abs(exact - batch) > 1e-9 or batch < 1:
        raise ConfigError(
            f"per_device_batch_size={per_device_batch_size} x {devices} devices = {exact:g} sequences; "
            "the global batch must be a whole number >= 1"
        )
    shards = mesh_shape["data"] * mesh_shape["fsdp"] * mesh_shape["expert"]
    if batch % accumulation_steps or (batch // accumulation_steps) % shards:
        raise ConfigError(
            f"global batch {batch} / gradient_accumulation_steps={accumulation_steps} must be a whole number divisible "
            f"by data*fsdp*expert={shards} (mesh {dict(mesh_shape)}); change per_device_batch_size or the mesh"
        )
    return batch


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
    return f"{base.rstrip('/')}/{cfg.run_name}" if "://" in base else ""


def checkpoint_directory(cfg: CheckpointConfig, base_output_directory: str, run_name: str) -> str:
    """`checkpoint_dir`, or base_output_directory/run_name/checkpoints; `gs://` paths stay URLs."""
    if cfg.checkpoint_dir:
        return cfg.checkpoint_dir
    return f"{base_output_directory.rstrip('/')}/{run_name}/checkpoints"
