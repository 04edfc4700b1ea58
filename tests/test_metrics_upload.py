"""gcs_metrics: metrics written under a gs:// base through etils' file layer (a local folder
stands in for the bucket: fsspec's `gs` protocol is pointed at it), and where the other run
files go when the base is a URL."""

import json
import logging
from pathlib import Path

import fsspec
import jax
import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.local import LocalFileSystem

from conftest import tiny_config
from tessera import metrics
from tessera.config.derived import plan_run, remote_run_dir, run_dir
from tessera.train import run


class FolderBucket(LocalFileSystem):
    """gs://bucket/key stored as <root>/bucket/key; set `root` before use."""

    protocol = ("gs", "gcs")
    root = Path("/nonexistent")
    fail = False

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                return str(cls.root / path[len(prefix):])
        return super()._strip_protocol(path)

    def open(self, path, mode="rb", **kwargs):
        if self.fail and "w" in mode:
            raise OSError("503 service unavailable")
        return super().open(path, mode, **kwargs)


def _point_gs_at(implementation):
    for name in ("gs", "gcs"):  # etils asks fsspec for "gcs"
        fsspec.register_implementation(name, implementation, clobber=True)
    epath_backend.fsspec_backend._get_filesystem.cache_clear()  # etils caches the filesystem


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    monkeypatch.setattr(FolderBucket, "root", tmp_path / "bucket-store")
    FolderBucket.clear_instance_cache()
    _point_gs_at(FolderBucket)
    yield tmp_path / "bucket-store"
    _point_gs_at("gcsfs.GCSFileSystem")
    FolderBucket.clear_instance_cache()


def _record(step):
    return {"step": step, "loss": 1.0 / step, "step_seconds": 0.1, "tflops_per_sec_per_device": 0.0,
            "tokens_per_sec_per_device": 0.0, "mfu": None}


def test_records_are_uploaded_in_whole_files_and_at_close(bucket, tmp_path):
    writer = metrics.MetricsWriter(tmp_path / "local" / "metrics.jsonl", None, log_period=1000,
                                   upload_dir="gs://runs/r1/metrics")
    for step in range(1, metrics.UPLOAD_EVERY + 31):
        writer.write(_record(step))
    uploaded = sorted((bucket / "runs" / "r1" / "metrics").iterdir())
    assert [p.name for p in uploaded] == [f"metrics_00000001_{metrics.UPLOAD_EVERY:08d}.jsonl"]
    writer.close()
    uploaded = sorted((bucket / "runs" / "r1" / "metrics").iterdir())
    assert len(uploaded) == 2
    steps = [json.loads(line)["step"] for p in uploaded for line in p.read_text().splitlines()]
    assert steps == list(range(1, metrics.UPLOAD_EVERY + 31))
    local = [json.loads(line)["step"] for line in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
    assert local == steps  # the local copy has them all too


def test_a_failed_upload_keeps_its_records_for_the_next(bucket, tmp_path, caplog, monkeypatch):
    writer = metrics.MetricsWriter(tmp_path / "metrics.jsonl", None, log_period=1000, upload_dir="gs://runs/r2/m")
    monkeypatch.setattr(FolderBucket, "fail", True)
    with caplog.at_level(logging.WARNING):
        for step in range(1, metrics.UPLOAD_EVERY + 1):
            writer.write(_record(step))
    assert "could not write gs://runs/r2/m/metrics_00000001" in caplog.text
    monkeypatch.setattr(FolderBucket, "fail", False)
    writer.write(_record(metrics.UPLOAD_EVERY + 1))
    writer.close()
    files = list((bucket / "runs" / "r2" / "m").iterdir())
    assert [f.name for f in files] == [f"metrics_00000001_{metrics.UPLOAD_EVERY + 1:08d}.jsonl"]
    assert len(files[0].read_text().splitlines()) == metrics.UPLOAD_EVERY + 1


def test_a_url_base_keeps_run_files_local_and_uploads_metrics_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shape = {"data": 1, "fsdp": 1, "expert": 1}
    cfg = tiny_config(base_output_directory="gs://bucket/runs", run_name="r3", gcs_metrics=True)
    plan = plan_run(cfg, shape)
    assert remote_run_dir(cfg.run) == "gs://bucket/runs/r3"
    assert plan.run_dir == tmp_path / "outputs" / "r3" == run_dir(cfg.run)
    assert plan.metrics_upload_dir == "gs://bucket/runs/r3/metrics"
    assert plan.checkpoint_dir == "gs://bucket/runs/r3/checkpoints"
    assert plan_run(tiny_config(base_output_directory="gs://bucket/runs", run_name="r3"), shape).metrics_upload_dir == ""
    local = tiny_config(tmp_path, gcs_metrics=True)  # a local base: the metrics are there already
    assert plan_run(local, shape).metrics_upload_dir == "" and remote_run_dir(local.run) == ""


@pytest.mark.parametrize("name", ["r5/", "sweep//r5", "sweep/r5/"])
def test_a_trailing_or_doubled_slash_in_run_name_is_the_same_bucket_folder(tmp_path, monkeypatch, name):
    """run_name=r5/ (a shell's completion of a folder name) is the local folder r5, but in a bucket
    gs://bucket/runs/r5//checkpoints is another folder than gs://bucket/runs/r5/checkpoints: a resume with
    run_name=r5 found no checkpoint there, and trained again from step 0 beside the local files of the run."""
    monkeypatch.chdir(tmp_path)
    shape = {"data": 1, "fsdp": 1, "expert": 1}
    clean = name.replace("//", "/").strip("/")
    cfg = tiny_config(base_output_directory="gs://bucket/runs/", run_name=name, gcs_metrics=True)
    plan = plan_run(cfg, shape)
    assert remote_run_dir(cfg.run) == f"gs://bucket/runs/{clean}"
    assert plan.checkpoint_dir == f"gs://bucket/runs/{clean}/checkpoints"
    assert plan.metrics_upload_dir == f"gs://bucket/runs/{clean}/metrics"
    assert plan.run_dir == tmp_path / "outputs" / clean


def test_a_run_with_a_gs_base_writes_its_metrics_to_the_bucket(bucket, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config(base_output_directory="gs://bucket/runs", run_name="r4", gcs_metrics=True, steps=3,
                      enable_checkpointing=False, enable_tensorboard=False)
    with caplog.at_level(logging.INFO, logger="tessera"):
        report = run(cfg, jax.devices()[:1])
    assert report["steps"] == 3
    uploaded = list((bucket / "bucket" / "runs" / "r4" / "metrics").iterdir())
    assert [p.name for p in uploaded] == ["metrics_00000001_00000003.jsonl"]
    losses = [json.loads(line)["loss"] for line in uploaded[0].read_text().splitlines()]
    local = tmp_path / "outputs" / "r4"
    assert losses == [json.loads(line)["loss"] for line in (local / "metrics.jsonl").read_text().splitlines()]
    assert (local / "report.json").is_file() and not (tmp_path / "gs:").exists()
    assert "base_output_directory is a URL" in caplog.text


def test_closing_on_a_full_disk_warns_instead_of_raising(tmp_path, caplog):
    """A run stopped by a full disk (the save failed) closes its writers on the way out: TensorBoard's
    flush failed there too, and its OSError replaced the save's message with a traceback (exit 1, not 6)."""
    import errno

    class FullDisk:
        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    writer = metrics.MetricsWriter(tmp_path / "metrics.jsonl", None, log_period=1000)
    writer._tb = FullDisk()
    with caplog.at_level("WARNING"):
        writer.close()
    assert ("the TensorBoard files could not be flushed (No space left on device); the records of the last steps may "
            "be missing from it") in caplog.text


# ---------------------------------------------------------------- the local files on a full disk

FULL_DISK_SCRIPT = """
import resource, signal, sys
from pathlib import Path
from tessera import metrics
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, a write fails with EFBIG instead of killing us
folder = Path(sys.argv[1])
writer = metrics.MetricsWriter(folder / "metrics.jsonl", folder / "tensorboard" if sys.argv[2] == "tb" else None,
                               log_period=1000)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # every file now stops at 4 KiB
try:
    for step in range(2, 500):  # (step 1 is logged, which needs a whole record)
        writer.write({"step": step, "loss": 1.0 / step, "grad_norm": 0.5, "learning_rate": 1e-3, "seconds": 0.1})
except metrics.MetricsWriteError as e:
    print("stopped:", e)
writer.close()
"""


@pytest.mark.parametrize("tensorboard", ["tb", "no tb"])
def test_a_full_disk_stops_the_metrics_with_one_error_instead_of_a_hang_or_a_traceback(tmp_path, tensorboard):
    """A file that cannot grow (a full disk; here the process's file size limit, so that any user can
    run it): with TensorBoard, tensorboardX's writer thread died and the next add_scalar blocked
    the training loop for ever on its full queue; without it, metrics.jsonl's OSError ended the run
    with a traceback (exit 1). Now MetricsWriteError names the file (train.py: exit code 6)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(tmp_path), tensorboard], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert line.startswith("stopped: the ") and "could not be written to" in line, proc.stdout + proc.stderr
    assert "(File too large); free some space (or fix the folder's permissions) and run the same command again: it " \
           "resumes from the last checkpoint" in line


def test_tensorboard_holds_each_record_as_soon_as_it_is_written(tmp_path):
    """tensorboardX flushed every 120 s: a run killed (or ended by the watchdog, os._exit) left an
    empty event file, and the resumed run never wrote the lost steps again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = metrics.MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tb", log_period=1000)
    for step in (2, 3, 4):  # (step 1 is logged, which needs a whole record)
        writer.write({"step": step, "loss": 1.0 / step})
    writer.write_eval({"step": 4, "eval_loss": 0.25, "eval_perplexity": 1.28, "eval_tokens": 10, "eval_batches": 1,
                       "eval_seconds": 0.1})
    events = EventAccumulator(str(tmp_path / "tb"))  # read before close, as after a kill -9
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(2, 0.5), (3, pytest.approx(1 / 3)),
                                                                         (4, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(4, 0.25)]
    writer.close()


def test_tensorboard_shows_the_steps_a_resumed_attempt_trains_again_once(tmp_path):
    """An attempt killed after step 7 with its last checkpoint at 4: the next one (first_step=5)
    trains 5-7 again. TensorBoard showed both attempts' 5-7, its curve going back from 7 to 5; a
    restart marker at the first step makes it keep the later ones, as metrics.jsonl's readers do."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = metrics.MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tb", log_period=1000)
    for step in range(2, 8):
        first.write({**_record(step), "loss": 1.0})
    first.write_eval({"step": 6, "eval_loss": 1.0, "eval_perplexity": 2.7, "eval_tokens": 10, "eval_batches": 1,
                      "eval_seconds": 0.1})
    time.sleep(1.1)  # event files are named by the second they were opened in
    second = metrics.MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tb", log_period=1000, first_step=5)
    for step in range(5, 10):
        second.write({**_record(step), "loss": 2.0})
    second.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(s, 1.0) for s in (2, 3, 4)] + [
        (s, 2.0) for s in range(5, 10)]
    assert events.Scalars("eval/loss") == []  # step 6's evaluation was the lost attempt's


def test_a_non_finite_value_goes_to_tensorboard_without_a_warning_per_step(tmp_path, caplog):
    """tensorboardX's `scalar` logged 'NaN or Inf found in input tensor.' for each non-finite value:
    a line per skipped step of on_nonfinite_loss=skip_step, which the run's own log already explains."""
    import math

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = metrics.MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tb", log_period=1000)
    with caplog.at_level("WARNING"):
        for step in (2, 3):
            writer.write({"step": step, "loss": float("nan"), "grad_norm": float("inf")})
    writer.close()
    assert "NaN or Inf" not in caplog.text
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 3]
    assert all(math.isnan(e.value) for e in events.Scalars("train/loss"))
    assert [e.value for e in events.Scalars("train/grad_norm")] == [math.inf, math.inf]


def test_run_folder_files_blocked_by_the_other_kind_are_refused_before_compiling(tmp_path):
    """A file named tensorboard, or a folder named metrics.jsonl, in the run folder ended a run after
    its compile with a traceback (NotADirectoryError, IsADirectoryError)."""
    from tessera.config import ConfigError

    folder = tmp_path / "test"
    folder.mkdir()
    (folder / "tensorboard").write_text("")
    with pytest.raises(ConfigError, match=r"tensorboard \(in the run folder, from base_output_directory\) is a file, "
                                          "where the run writes a folder; move it away, or choose another run_name"):
        run(tiny_config(tmp_path, enable_tensorboard=True), jax.devices()[:1])
    (folder / "tensorboard").unlink()
    (folder / "metrics.jsonl").mkdir()
    with pytest.raises(ConfigError, match=r"metrics.jsonl \(in the run folder, from base_output_directory\) is a "
                                          "folder, where the run writes a file"):
        run(tiny_config(tmp_path), jax.devices()[:1])


def test_a_url_metrics_file_is_refused_instead_of_written_to_a_local_gs_folder(tmp_path, monkeypatch):
    """metrics_file=gs://bucket/m.jsonl trained and wrote its records to ./gs:/bucket/m.jsonl, a local
    folder Path() made of the URL, without a word."""
    from tessera.config import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"metrics_file=gs://bucket/m.jsonl is a URL; .* set base_output_directory "
                                          "to a gs:// folder and gcs_metrics=true"):
        run(tiny_config(tmp_path, metrics_file="gs://bucket/m.jsonl"), jax.devices()[:1])
    assert not (tmp_path / "gs:").exists()


def test_an_upload_folder_of_a_scheme_without_a_client_is_refused_before_training(tmp_path, caplog):
    # file:// or hdfs:// has no etils client: the first upload raised KeyError after the last step, a traceback
    # (exit 1) in place of the report; now one line at start-up, and a warning if the writer meets one
    # (a file: URL is refused earlier still, when the config is built: it names the local path to write)
    from tessera.config import ConfigError
    from tessera.output_folders import check_output_folders

    with pytest.raises(ConfigError, match=r"base_output_directory=file://.*/runs is a file: URL"):
        tiny_config(base_output_directory=f"file://{tmp_path}/runs", run_name="r5", gcs_metrics=True)
    cfg = tiny_config(base_output_directory="hdfs://cluster/runs", run_name="r5", gcs_metrics=True,
                      enable_checkpointing=False)
    with pytest.raises(ConfigError, match=r"gcs_metrics=true with base_output_directory=hdfs://cluster/runs: no "
                                          r"client writes to hdfs:// URLs"):
        check_output_folders(cfg, "")
    writer = metrics.MetricsWriter(tmp_path / "metrics.jsonl", None, log_period=1000,
                                   upload_dir=f"file://{tmp_path}/m")
    writer.write(_record(1))
    with caplog.at_level(logging.WARNING):
        writer.close()
    assert f"could not write file://{tmp_path}/m/metrics_00000001_00000001.jsonl" in caplog.text
