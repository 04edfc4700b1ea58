"""The output folders of a run, checked before anything is compiled: each one the run will write
(the run folder, the checkpoint folder, the metrics file, TensorBoard's and the profiler's
folders) can be written and holds nothing of another kind under its name; none is another run's
step folder or lies in one; and no checkpoint or finished run already in them would be left
unread by this start. Each problem is one ConfigError that names the key to change."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import yaml

from tessera.checkpointing import PYTREE_METADATA_FILE, check_writable
from tessera.config import Config, ConfigError
from tessera.config.derived import checkpoint_directory, remote_run_dir, run_dir
from tessera.run_folder import LOCK_FILE


def check_output_folders(cfg: Config, ckpt_dir: str) -> None:
    """ConfigError now, before anything is compiled, for an output folder that cannot be written
    (a parent that is a file, no permission), or that lies in another run's step folder; the probe
    leaves nothing behind."""
    if not remote_run_dir(cfg.run):
        _refuse_run_inside_step(cfg.run.base_output_directory)
    check_writable(str(run_dir(cfg.run)), "base_output_directory", "the run folder")
    if cfg.checkpoint.enable_checkpointing:
        if cfg.checkpoint.checkpoint_dir:
            _refuse_checkpoint_inside(ckpt_dir)
            check_writable(ckpt_dir, "checkpoint_dir")
        else:
            check_writable(ckpt_dir, "base_output_directory", "the checkpoint folder")
    if cfg.run.gcs_metrics and remote_run_dir(cfg.run):  # else the first upload, after the last step, failed
        _check_upload_scheme(cfg.run.base_output_directory)
    if "://" in cfg.run.metrics_file:  # Path() would make gs://b/m.jsonl the local file gs:/b/m.jsonl
        raise ConfigError(f"metrics_file={cfg.run.metrics_file} is a URL; metrics_file is a local file, appended to "
                          "after every step, which an object store cannot do. For metrics in a bucket, set "
                          "base_output_directory to a gs:// folder and gcs_metrics=true (metrics.jsonl stays local)")
    if cfg.run.metrics_file:
        if Path(cfg.run.metrics_file).is_dir():
            raise ConfigError(f"metrics_file={cfg.run.metrics_file} is a folder; give the path of a file, e.g. "
                              f"{Path(cfg.run.metrics_file) / 'metrics.jsonl'}")
        check_writable(str(Path(cfg.run.metrics_file).parent), "metrics_file", "the metrics file's folder")
        _refuse_run_file_as_metrics(Path(cfg.run.metrics_file), run_dir(cfg.run))
    else:  # the run folder's own files, where something else may sit under their names
        _check_kind(run_dir(cfg.run) / "metrics.jsonl", "a file", "base_output_directory")
    _check_appendable(Path(cfg.run.metrics_file) if cfg.run.metrics_file else run_dir(cfg.run) / "metrics.jsonl",
                      "metrics_file" if cfg.run.metrics_file else "base_output_directory")
    if cfg.run.enable_tensorboard:
        _check_kind(run_dir(cfg.run) / "tensorboard", "a folder", "base_output_directory")
        if (run_dir(cfg.run) / "tensorboard").is_dir():  # a resumed run's (a new one's is made in the checked folder)
            check_writable(str(run_dir(cfg.run) / "tensorboard"), "base_output_directory", "the TensorBoard folder")
    if cfg.profiler.profiler:
        _check_kind(run_dir(cfg.run) / "profile", "a folder", "base_output_directory")
    for name in (LOCK_FILE, "config.yml", "report.json"):  # the lock, taken first; the others written after compiling
        _check_kind(run_dir(cfg.run) / name, "a file", "base_output_directory")


def _check_appendable(path: Path, key: str) -> None:
    """ConfigError for an existing metrics file the run cannot append to (read-only, another user's): the
    writer opened it after compiling, a PermissionError traceback (exit code 1). A pipe or device is
    not opened here (a named pipe would block until it has a reader)."""
    if jax.process_index() != 0 or not path.is_file():
        return
    try:
        with open(path, "rb+"):  # as the writer opens it (a record cut off at the end is removed); nothing changes
            pass
    except OSError as e:
        raise ConfigError(f"the metrics file {path} (from {key}) cannot be written ({e.strerror or e}): the run "
                          "appends each step's record to it; make it writable, or choose another "
                          f"{'metrics_file' if key == 'metrics_file' else 'run_name'}") from None


def _refuse_run_file_as_metrics(metrics_file: Path, folder: Path) -> None:
    """ConfigError for a metrics_file that is a file the run writes itself in its folder: report.json
    replaced the records with the report at the end, the lock's removal deleted them, config.yml (and an
    earlier attempt's report, renamed at a resume) mixed them with other contents; exit code 0 each time."""
    path = metrics_file.resolve()
    if path.parent != folder.resolve():
        return
    what = {LOCK_FILE: "the run folder's lock, removed when the run ends",
            "config.yml": "the run's config, written at its start (and read at a resume)",
            "report.json": "the run's report, which replaces it when the run ends"}.get(path.name)
    if what is None and path.name.startswith("report.until_"):
        what = "an earlier attempt's report"
    if what is not None:
        raise ConfigError(f"metrics_file={metrics_file} is {what}: its records would be lost or mixed with it; "
                          f"give a file of its own, or leave metrics_file out ({folder / 'metrics.jsonl'})")


def _refuse_checkpoint_inside(ckpt_dir: str) -> None:
    """ConfigError for a checkpoint_dir that is a step folder, one of its items or a run folder: it holds
    no step folders itself, so the run started from step 0 and saved its steps inside it, without a word."""
    p = Path(ckpt_dir)
    if "://" in ckpt_dir or not p.is_dir():
        return
    step = _step_folder_holding(p)
    if step is not None:
        raise ConfigError(f"checkpoint_dir={ckpt_dir} is {'the step folder' if step == p else 'in the step folder'} "
                          f"{step}, not a folder of step folders: this run would start from step 0 and save inside it. "
                          f"To start from that step, use load_full_state_path={step} (or load_parameters_path={step} "
                          f"for its parameters alone); to save beside its run's steps, checkpoint_dir={step.parent}")
    own = p / "checkpoints"
    if own.is_dir() and any(c.name.isdigit() for c in own.iterdir()) and not any(c.name.isdigit() for c in p.iterdir()):
        raise ConfigError(f"checkpoint_dir={ckpt_dir} is a run folder, whose step folders are in {own}: this run "
                          f"would start from step 0 and save its steps there, beside checkpoints/; give checkpoint_dir={own} to "
                          f"train on from its newest step, or load_full_state_path=<one of its steps> for a new run")


def _step_folder_holding(path: Path) -> Path | None:
    """The saved step folder (a number, with a saved state item) that `path` is or lies in, or None."""
    return next((f for f in (path, *path.parents) if f.name.isdigit() and (f / "state" / PYTREE_METADATA_FILE).is_file()),
                None)


def _refuse_run_inside_step(base: str) -> None:
    """ConfigError for a base_output_directory that is another run's step folder or lies in one (meant as
    a load path, most often): when that run keeps only its newest checkpoints (max_num_checkpoints_to_keep),
    or sets a damaged one aside, this run's folder goes with the step folder, checkpoints and all."""
    folder = Path(base).absolute()
    step = _step_folder_holding(folder)
    if step is None:
        return
    outside = f" (such as {step.parents[2]})" if step.parent.name == "checkpoints" and len(step.parents) > 2 else ""
    where = "a step folder" if step == folder else f"in the step folder {step}"
    raise ConfigError(f"base_output_directory={base} is {where}, another run's checkpoint: when that run keeps only "
                      "its newest checkpoints (max_num_checkpoints_to_keep) it deletes the folder, and this run's files "
                      f"with it. To start from that step, use load_full_state_path={step} (or load_parameters_path="
                      f"{step} for its parameters alone); give base_output_directory a folder outside it{outside}")


def _check_upload_scheme(base: str) -> None:
    """ConfigError for a URL base_output_directory whose scheme etils (the file layer gcs_metrics
    writes through) has no client for, such as file://."""
    from etils import epath

    try:
        epath.Path(base)
    except KeyError:
        scheme = base.split("://", 1)[0]
        raise ConfigError(f"gcs_metrics=true with base_output_directory={base}: no client writes to {scheme}:// "
                          "URLs (gs://, s3://, az:// and hf:// have one); use one of those, or a local folder "
                          "(without ://), where metrics.jsonl holds every record") from None


def _check_kind(path: Path, kind: str, key: str) -> None:
    """ConfigError when `path`, which the run writes as `kind` ("a file" or "a folder"), exists as the other."""
    if "://" in str(path) or not path.exists() or path.is_dir() == (kind == "a folder"):
        return
    raise ConfigError(f"{path} (in the run folder, from {key}) is {'a folder' if kind == 'a file' else 'a file'}, "
                      f"where the run writes {kind}; move it away, or choose another run_name")


def refuse_unread_checkpoints(cfg: Config, ckpt_dir: str) -> None:
    """ConfigError when the run's own checkpoint folder holds steps this start would not read
    (enable_checkpointing=false, or checkpoint_dir elsewhere with nothing in it), or when the run
    folder holds a finished run's report: it would train again from step 0 beside them, append
    to their metrics and replace their config and report. (Called when there is no checkpoint to
    resume from.)"""
    own = checkpoint_directory(dataclasses.replace(cfg.checkpoint, checkpoint_dir=""), cfg.run.base_output_directory,
                               cfg.run.run_name)
    local = "://" not in own and not (cfg.checkpoint.enable_checkpointing and own == ckpt_dir) and Path(own).is_dir()
    steps = sorted(int(p.name) for p in Path(own).iterdir() if p.name.isdigit() and p.is_dir()) if local else []
    if steps:
        why = ("enable_checkpointing=false" if not cfg.checkpoint.enable_checkpointing else
               f"checkpoint_dir={cfg.checkpoint.checkpoint_dir} holds none")
        raise ConfigError(f"{own} holds this run's checkpoints up to step {steps[-1]}, which this start would not "
                          f"read ({why}): it would train again from step 0 beside them. To continue the run, leave "
                          f"out {why.split('=')[0]}; for a new run, choose a new run_name")
    before = _saved_checkpoint_dir(run_dir(cfg.run) / "config.yml")
    if before and (before != ckpt_dir or not cfg.checkpoint.enable_checkpointing) and "://" not in before \
            and Path(before).is_dir():
        steps = sorted(int(p.name) for p in Path(before).iterdir() if p.name.isdigit() and p.is_dir())
        if steps:
            why = "enable_checkpointing=false" if not cfg.checkpoint.enable_checkpointing else \
                f"checkpoint_dir={cfg.checkpoint.checkpoint_dir or '(not set)'}"
            raise ConfigError(f"{run_dir(cfg.run)} is a run whose checkpoints, up to step {steps[-1]}, are in {before} "
                              f"(checkpoint_dir in its config.yml), which this start would not read ({why}): it would "
                              f"train again from step 0. To continue the run, give checkpoint_dir={before}; for a new "
                              "run, choose a new run_name")
    folder = run_dir(cfg.run)  # its report, or an earlier attempt's (`_set_aside_earlier_report`)
    report = next((p for p in (folder / "report.json", *sorted(folder.glob("report.until_*.json"))) if p.is_file()),
                  None)
    if report is not None:  # a run that ended (enable_checkpointing=false, or its checkpoints deleted since)
        raise ConfigError(f"{report.parent} holds a run that finished ({report.name}) and no checkpoint this start "
                          "could resume from: it would train again from step 0 and mix its metrics with the finished "
                          "run's. For a new run, choose a new run_name (or move that folder away)")


def _saved_checkpoint_dir(config_file: Path) -> str:
    """The checkpoint_dir the run folder's config.yml (written by the run's last start) names; "" when it
    names none (the default folder, checked apart) or cannot be read."""
    try:
        saved = yaml.safe_load(config_file.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return ""
    value = saved.get("checkpoint_dir") if isinstance(saved, dict) else None
    return value if isinstance(value, str) else ""
