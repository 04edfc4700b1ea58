"""What a run writes outside its checkpoints, in the run folder (base_output_directory/run_name):
the output folders checked before anything is compiled, config.yml once the state and the step are
known good, and report.json at the end. `tessera.train` calls these in that order."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import yaml

from tessera import metrics
from tessera.checkpointing import check_writable
from tessera.config import Config, ConfigError, config_digest, flat_dict
from tessera.config.derived import remote_run_dir, run_dir
from tessera.evaluation import at_target
from tessera.loop_records import input_bound_warning, time_line

if TYPE_CHECKING:
    from tessera.loop_records import RunClock, StepMeter
    from tessera.step import Trainer

log = logging.getLogger("tessera")


def check_output_folders(cfg: Config, ckpt_dir: str) -> None:
    """ConfigError now, before anything is compiled, for an output folder that cannot be written
    (a parent that is a file, no permission); the probe leaves nothing behind."""
    check_writable(str(run_dir(cfg.run)), "base_output_directory", "the run folder")
    if cfg.checkpoint.enable_checkpointing:
        if cfg.checkpoint.checkpoint_dir:
            check_writable(ckpt_dir, "checkpoint_dir")
        else:
            check_writable(ckpt_dir, "base_output_directory", "the checkpoint folder")
    if cfg.run.metrics_file:
        if Path(cfg.run.metrics_file).is_dir():
            raise ConfigError(f"metrics_file={cfg.run.metrics_file} is a folder; give the path of a file, e.g. "
                              f"{Path(cfg.run.metrics_file) / 'metrics.jsonl'}")
        check_writable(str(Path(cfg.run.metrics_file).parent), "metrics_file")


def create_run_folder(cfg: Config, folder: Path) -> Path:
    """`folder` (base_output_directory/run_name) with the full final config in config.yml."""
    folder.mkdir(parents=True, exist_ok=True)
    if remote_run_dir(cfg.run):
        log.info("base_output_directory is a URL (run folder %s): config.yml, TensorBoard, the report and metrics.jsonl "
                 "are kept locally in %s; %s", remote_run_dir(cfg.run), folder,
                 "the metrics also go to the run folder's metrics/ (gcs_metrics=true)" if cfg.run.gcs_metrics
                 else "set gcs_metrics=true to write the metrics to the run folder too")
    if cfg.compile.compiled_trainstep_file:
        log.info("compiled_trainstep_file=%s is written by train_compile; train.py compiles its own step",
                 cfg.compile.compiled_trainstep_file)
    if jax.process_index() == 0:
        (folder / "config.yml").write_text(yaml.safe_dump(flat_dict(cfg), sort_keys=False))
    log.info("run %s -> %s (full config in config.yml, digest %s)", cfg.run.run_name, folder, config_digest(cfg))
    return folder


def write_report(cfg: Config, trainer: Trainer, writer: metrics.MetricsWriter, meter: StepMeter, folder: Path,
                 n_params: int, compile_seconds: float, start_step: int, clock: RunClock) -> dict[str, Any]:
    """The run report: logged, written as report.json (process 0) and returned. Its `time` is
    `clock`'s account of the run's wall time by phase, with the goodput (`loop_records.RunClock`)."""
    reached = [r["step"] for r in writer.eval_records if at_target(cfg.data, r["eval_loss"])]
    report = metrics.run_report(
        writer.records, cfg.run.report_warmup_steps, run_name=cfg.run.run_name, config_digest=config_digest(cfg),
        device_kind=meter.device_kind, num_devices=trainer.mesh.size, mesh=dict(trainer.mesh.shape),
        peak_tflops_per_device=meter.peak, flops_per_step=meter.flops, num_parameters=n_params,
        compile_seconds=compile_seconds, attention_kernel=trainer.model.attention_kernel,
        global_batch=trainer.plan.global_batch, max_target_length=trainer.plan.max_target_length, start_step=start_step,
        final_eval_loss=writer.eval_records[-1]["eval_loss"] if writer.eval_records else None,
        **{f"final_{k}": v for k, v in (writer.eval_records[-1] if writer.eval_records else {}).items()
           if k.startswith("eval_mtp_")},  # multi-token prediction's eval loss and acceptance rate
        target_eval_loss_reached_at=reached[0] if reached else None,
        time=clock.summary(),
    )
    if jax.process_index() == 0:
        (folder / "report.json").write_text(json.dumps(report, indent=2))
    log.info(time_line(report["time"]))
    slow_input = input_bound_warning(report["time"], cfg.data.dataset_type)
    if slow_input:
        log.warning(slow_input)
    log.info("done: final loss %.4f, median %.3f s/step; report %s", report["final_loss"], report["step_seconds"],
             folder / "report.json")
    return report
