"""Faults that must not lose more than the step in flight (issue 13), through real train.py runs:
damaged checkpoints, an unwritable output folder, a full disk, Ctrl-C once and twice."""

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import HELD_LINE, held_before, sigterm_after_line
from test_checkpointing import TRAIN, _losses, _train, _wait_for, two_steps  # noqa: F401 (a fixture)

ECHOES = ("Traceback", "Exception ignored", "never retrieved", "Task was destroyed")


def _no_echoes(stderr: str) -> None:
    found = [e for e in ECHOES if e in stderr]
    assert not found, f"{found} in stderr:\n{stderr[-3000:]}"


def _steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


@pytest.mark.slow
def test_truncated_array_file_is_one_message_every_time(tmp_path, two_steps):
    shutil.copytree(two_steps, tmp_path / "sub")
    step = tmp_path / "sub" / "checkpoints" / "2"
    data = max((p for p in (step / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    size = data.stat().st_size
    os.truncate(data, size // 2)
    # the checksums recorded at the save catch it before Orbax reads anything
    proc = _train(tmp_path, "steps=4")
    assert proc.returncode == 2, proc.stderr[-3000:]
    _no_echoes(proc.stderr)
    assert (f"checkpoint error: checkpoint {step} is damaged: its file {data.relative_to(step)} has {size // 2} bytes, "
            f"{size} when it was saved. Move it away") in proc.stderr
    # without them (checkpoint_checksums=false, or a checkpoint saved without a list) Orbax's read fails
    for _ in range(5):  # the echoes came in 2 of 7 runs: they depend on which reads are still pending
        proc = _train(tmp_path, "steps=4", "checkpoint_checksums=false")
        assert proc.returncode == 2, proc.stderr[-3000:]
        _no_echoes(proc.stderr)
        assert f"checkpoint error: checkpoint {step} could not be restored" in proc.stderr
        assert "to start this run from step 0" in proc.stderr and "TensorStore details" not in proc.stderr


@pytest.mark.slow
def test_deleted_metadata_is_a_damaged_checkpoint_not_a_config_mismatch(tmp_path):
    assert _train(tmp_path, "steps=2", "checkpoint_period=1").returncode == 0
    ckpt = tmp_path / "sub" / "checkpoints"
    (ckpt / "2" / "state" / "_METADATA").unlink()
    proc = _train(tmp_path, "steps=3")
    assert proc.returncode == 2 and "does not match" not in proc.stderr, proc.stderr[-3000:]
    _no_echoes(proc.stderr)
    assert (f"checkpoint error: checkpoint {ckpt / '2'} is damaged: its file state/_METADATA is missing. "
            f"Move it away (e.g. mv {ckpt / '2'} {ckpt / '2'}.damaged) to resume from step 1") in proc.stderr
    # the converter says the same in one line, and writes nothing
    proc = _convert("tessera-to-hf", str(ckpt / "2"), str(tmp_path / "hf"))
    assert proc.returncode == 2 and not (tmp_path / "hf").exists(), proc.stderr
    assert proc.stderr.startswith(f"checkpoint error: checkpoint {ckpt / '2'} is damaged: its file state/_METADATA is "
                                  "missing")
    _no_echoes(proc.stderr)
    (ckpt / "2").rename(ckpt / "2.damaged")  # what the message says to do
    again = _train(tmp_path, "steps=3")
    assert again.returncode == 0 and "resuming from step 1" in again.stderr, again.stderr[-3000:]


def test_an_empty_step_folder_past_the_last_step_is_not_a_finished_run(tmp_path, two_steps):
    shutil.copytree(two_steps, tmp_path / "sub")
    empty = tmp_path / "sub" / "checkpoints" / "8"
    empty.mkdir()  # e.g. a copy that was cut short
    proc = _train(tmp_path, "steps=6")  # 8 >= 6: without the check this said "nothing to do" and exited 0
    assert proc.returncode == 2 and "nothing to do" not in proc.stderr, proc.stderr[-3000:]
    _no_echoes(proc.stderr)
    assert (f"checkpoint error: checkpoint {empty} is damaged: its file state/_METADATA is missing. "
            f"Move it away (e.g. mv {empty} {empty}.damaged) to resume from step 2") in proc.stderr


def test_output_folder_under_a_file_is_refused_before_compiling(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    proc = subprocess.run([*TRAIN, "run_name=sub", f"base_output_directory={tmp_path}/file/out", "steps=1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _no_echoes(proc.stderr)
    assert (f"config error: the run folder {tmp_path}/file/out/sub (from base_output_directory) cannot be written: "
            f"{tmp_path}/file is a file, not a folder; choose another base_output_directory or fix the folder's "
            "permissions") in proc.stderr and "compiled" not in proc.stderr
    (tmp_path / "out2" / "sub").mkdir(parents=True)
    (tmp_path / "out2" / "sub" / "checkpoints").write_text("")  # the run folder is fine, its checkpoint folder not
    proc = subprocess.run([*TRAIN, "run_name=sub", f"base_output_directory={tmp_path}/out2", "steps=1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"config error: the checkpoint folder {tmp_path}/out2/sub/checkpoints (from base_output_directory) cannot "
            f"be written: {tmp_path}/out2/sub/checkpoints is a file, not a folder; choose another "
            "base_output_directory or fix the folder's permissions") in proc.stderr
    (tmp_path / "out2" / "sub" / "checkpoints").unlink()
    (tmp_path / "out2" / "sub").rmdir()
    (tmp_path / "out2").rmdir()
    proc = subprocess.run([*TRAIN, "run_name=sub", f"base_output_directory={tmp_path}/out", "steps=1",
                           f"metrics_file={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not (tmp_path / "out").exists(), proc.stderr[-3000:]
    _no_echoes(proc.stderr)
    assert f"config error: metrics_file={tmp_path} is a folder; give the path of a file" in proc.stderr
    # a compilation cache that cannot be written: JAX only warned, once, and every start compiled again
    proc = subprocess.run([*TRAIN, "run_name=sub", f"base_output_directory={tmp_path}/out", "steps=1",
                           f"jax_cache_dir={tmp_path}/file"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not (tmp_path / "out").exists(), proc.stderr[-3000:]
    _no_echoes(proc.stderr)
    assert (f"config error: jax_cache_dir={tmp_path}/file cannot be written: {tmp_path}/file is a file, not a "
            "folder; choose another jax_cache_dir") in proc.stderr
    # a folder under that file: refused before JAX sees it (JAX's own warning came first, at the first compile)
    proc = subprocess.run([*TRAIN, "run_name=sub", f"base_output_directory={tmp_path}/out", "steps=1",
                           f"jax_cache_dir={tmp_path}/file/cache"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not (tmp_path / "out").exists(), proc.stderr[-3000:]
    _no_echoes(proc.stderr)
    assert "Warning" not in proc.stderr and "compilation cache:" not in proc.stderr, proc.stderr[-3000:]
    assert (f"config error: jax_cache_dir={tmp_path}/file/cache cannot be written: {tmp_path}/file is a file, not a "
            "folder; choose another jax_cache_dir") in proc.stderr
    ckpt_dir = tmp_path / "ok" / "ckpts"  # a probe that succeeds leaves nothing either (no run folder yet)
    proc = subprocess.run([*TRAIN, "run_name=sub", f"base_output_directory={tmp_path}/ok", f"checkpoint_dir={ckpt_dir}",
                           "load_parameters_path=/nowhere"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not (tmp_path / "ok").exists(), proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_bucket_that_cannot_be_reached_is_one_line_before_compiling(tmp_path):
    """No network here (nor credentials): the bucket clients retried for about 50 s, logging a traceback
    per retry, then raised from deep inside Orbax. Now: one line, exit 2, nothing compiled; the
    service's host name is resolved first, so the line comes without the clients' retries."""
    url = "gs://tessera-test-no-such-bucket/runs"
    proc = subprocess.run([*TRAIN, "run_name=sub", f"base_output_directory={url}", "steps=1"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _no_echoes(proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"config error: the checkpoint folder {url}/sub/checkpoints "
                                                     "(from base_output_directory) cannot be reached (")
    assert "check the network, the bucket name and the credentials" in errors[0] and "compiled" not in proc.stderr
    assert "(the host name storage.googleapis.com does not resolve: " in errors[0]


@pytest.mark.parametrize("variable", ["STORAGE_EMULATOR_HOST", "HTTPS_PROXY", "HTTP_PROXY"])
def test_bucket_host_is_left_to_the_client_behind_an_emulator_or_a_proxy(monkeypatch, variable):
    """An emulator replaces the service, and a proxy resolves its name: only the client can tell."""
    import socket

    from tessera.data.errors import unresolvable_host

    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    assert unresolvable_host("gs://bucket/runs") == ("the host name storage.googleapis.com does not resolve: "
                                                     "Name or service not known")
    monkeypatch.setenv(variable, "http://127.0.0.1:9")
    assert unresolvable_host("gs://bucket/runs") is None
    assert unresolvable_host("/local/folder") is None


def test_each_remote_scheme_names_the_host_its_client_would_ask(monkeypatch):
    """http(s): the URL's host; hf: the Hub, or none with a mirror (HF_ENDPOINT); s3: left to its
    client (the endpoint is configurable); local paths: nothing to resolve."""
    import socket

    from tessera.data.errors import unresolvable_host

    asked = []

    def no_dns(host, *args, **kwargs):
        asked.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    for variable in ("STORAGE_EMULATOR_HOST", "HF_ENDPOINT", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY",
                     "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(variable, raising=False)
    assert unresolvable_host("https://data.example.org:8443/c4/000.parquet").startswith(
        "the host name data.example.org does not resolve")
    assert unresolvable_host("hf://datasets/org/name/train.parquet").startswith("the host name huggingface.co ")
    assert unresolvable_host("s3://bucket/x") is None and unresolvable_host("data/x.json") is None
    assert asked == ["data.example.org", "huggingface.co"]
    monkeypatch.setenv("HF_ENDPOINT", "https://mirror.internal")
    assert unresolvable_host("hf://datasets/org/name/train.parquet") is None


@pytest.mark.parametrize("keys", [
    ["dataset_type=hf", "hf_path=json", "hf_train_files=data/a.json,{url}/train.jsonl"],
    ["dataset_type=grain", "grain_file_type=parquet", "grain_train_files={url}/train.parquet"],
    ["dataset_type=tfds", "dataset_name=c4/en:3.1.0", "dataset_path={url}/tensorflow_datasets"],
], ids=["hf", "grain", "tfds"])
def test_data_whose_host_cannot_be_reached_is_one_line_before_compiling(tmp_path, keys):
    """Remote data files: the clients retried a host name that does not resolve for about 50 s, logging
    a traceback per retry, and the error then advised re-creating a damaged file. Now the name is
    resolved first: one line naming the key and the cause, exit 2, nothing compiled. `.invalid`
    names never resolve (RFC 2606), network or not."""
    url = "https://data.tessera.invalid"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.json").write_text('{"text": "a local file, found before the remote one"}\n')
    keys = [k.format(url=url) for k in keys]
    proc = subprocess.run([*TRAIN, "run_name=sub", "base_output_directory=out", "steps=1", *keys],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _no_echoes(proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    key, value = keys[-1].split("=", 1)
    remote = value.split(",")[-1]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"config error: {key}={remote!r} cannot be reached (the host name "
                                "data.tessera.invalid does not resolve: "), errors
    assert errors[0].endswith("); check the network and the address, or copy the files to a local disk and point the "
                              "key there"), errors
    assert "compiled" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 30 MiB tmpfs: one checkpoint of the 2-layer model (21 MB) fits, a second does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30M", "tmpfs", str(disk)], capture_output=True,
                           text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mount.stderr.strip()}): the disk-full test needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize("async_save", ["true", "false"])
@pytest.mark.slow
def test_disk_full_stops_at_once_and_keeps_the_last_checkpoint(small_disk, async_save):
    args = ["per_device_batch_size=1", "max_target_length=16", "base_num_decoder_layers=2", "checkpoint_period=1",
            f"async_checkpointing={async_save}"]
    cmd = [*TRAIN, "run_name=sub", f"base_output_directory={small_disk}", *args]
    proc = subprocess.run([*cmd, "steps=6"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 6, proc.stderr[-3000:]
    _no_echoes(proc.stderr)
    ckpt = small_disk / "sub" / "checkpoints"
    message = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(message) == 1 and message[0].startswith(f"checkpoint save error: saving checkpoint step 2 to {ckpt} "
                                                       "failed: No space left on device (free space there: ")
    assert f"The last complete checkpoint is step 1 ({ckpt / '1'})" in message[0]
    assert _steps(ckpt) == [1] and not [p for p in ckpt.iterdir() if "tmp" in p.name]
    assert max(_losses(small_disk / "sub")) <= 3  # stopped at the failed save or the step after it
    subprocess.run(["mount", "-o", "remount,size=200M", str(small_disk)], check=True)  # free space
    again = subprocess.run([*cmd, "steps=2"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "resuming from step 1" in again.stderr, again.stderr[-3000:]


def test_a_full_disk_at_the_start_is_one_line_before_compiling(small_disk):
    """A disk already full when a run starts: the folder check's probe was an empty file, which fits
    on a full disk, so the run compiled and then ended in a traceback (exit 1) writing its lock's note,
    leaving the lock file behind. Now the probe holds a few bytes and fails, with exit code 2's message;
    a disk that fills up between the check and config.yml gets the same message, not a traceback."""
    from conftest import tiny_config
    from tessera.config import ConfigError
    from tessera.output_folders import check_output_folders
    from tessera.run_folder import LOCK_FILE, RunFolderLock, create_run_folder

    with open(small_disk / "filler", "wb") as f, pytest.raises(OSError):
        while True:
            f.write(bytes(1 << 20))
            f.flush()
    cfg = tiny_config(small_disk)
    with pytest.raises(ConfigError, match=f"the run folder {small_disk / 'test'} \\(from base_output_directory\\) "
                                          "cannot be written: No space left on device; free some space there or "
                                          "choose another base_output_directory \\(free space there: 0.0 MiB"):
        check_output_folders(cfg, str(small_disk / "test" / "checkpoints"))
    assert [p.name for p in small_disk.iterdir()] == ["filler"]
    lock = RunFolderLock()
    with pytest.raises(ConfigError, match="cannot be written: No space left on device"):
        create_run_folder(cfg, small_disk / "test", lock)
    lock.release()
    assert not (small_disk / "test" / LOCK_FILE).exists()


def test_a_background_save_that_failed_is_reported_by_the_next_check(small_disk):
    """The loop calls check() after each step it does not save: a failed async save surfaces there,
    not only at the next save, which can be checkpoint_period steps later."""
    import jax
    import jax.numpy as jnp
    from conftest import tiny_config

    from tessera.checkpointing import Checkpointer, CheckpointSaveError

    ckpt = Checkpointer(tiny_config(async_checkpointing=True).checkpoint, str(small_disk / "ckpts"))
    # 20 MiB of random values (which do not compress): one save fits the 30 MiB disk, two do not
    state = {"w": jax.random.normal(jax.random.key(0), (5 * 2**20,), jnp.float32)}
    ckpt.save(1, state, {}, {})
    ckpt.save(2, state, {}, {})  # waits for step 1, then fails in the background
    errors = []

    def check_failed() -> bool:
        try:
            ckpt.check()
        except CheckpointSaveError as e:
            errors.append(str(e))
        return bool(errors)

    assert _wait_for(check_failed, 60, 0.05), "check() never reported the failed background save"
    assert errors[0].startswith(f"saving checkpoint step 2 to {small_disk / 'ckpts'} failed: No space left on device")
    assert "The last complete checkpoint is step 1" in errors[0]
    ckpt.close()  # the error was reported once; closing does not raise it again


@pytest.mark.parametrize("keep", [1, -1])
def test_a_full_disk_says_what_a_checkpoint_takes_and_that_keeping_fewer_deletes_only_after_a_save(small_disk, keep):
    """max_num_checkpoints_to_keep deletes the older checkpoints only once a new save is complete (the
    newest complete one is never deleted first), so a disk that holds N of them fills up at the
    N+1th save: the message said to free some space, not that N+1 must fit nor how much one takes."""
    import jax
    import jax.numpy as jnp
    from conftest import tiny_config

    from tessera.checkpointing import Checkpointer, CheckpointSaveError

    cfg = tiny_config(async_checkpointing=False, max_num_checkpoints_to_keep=keep).checkpoint
    ckpt = Checkpointer(cfg, str(small_disk / "ckpts"))
    state = {"w": jax.random.normal(jax.random.key(0), (5 * 2**20,), jnp.float32)}  # 20 MiB: one fits, two do not
    ckpt.save(1, state, {}, {})
    with pytest.raises(CheckpointSaveError) as e:
        ckpt.save(2, state, {}, {})
    assert _steps(small_disk / "ckpts") == [1]
    rule = ("max_num_checkpoints_to_keep=1 deletes older checkpoints only after a new one is complete, so the disk "
            "needs room for 2 of them" if keep == 1 else "every checkpoint is kept (max_num_checkpoints_to_keep=-1)")
    assert re.search(rf"run the same command again to resume\. Step 1 takes \d+\.\d MiB and {re.escape(rule)}$",
                     str(e.value)), str(e.value)
    ckpt.close()


def test_a_full_disk_names_the_older_checkpoints_that_may_be_deleted(small_disk):
    """Every checkpoint kept (the default): the disk fills up at some save, and the message names the
    steps before the last complete one, which the user may delete to make room."""
    import jax
    import jax.numpy as jnp
    from conftest import tiny_config

    from tessera.checkpointing import Checkpointer, CheckpointSaveError

    ckpt = Checkpointer(tiny_config(async_checkpointing=False).checkpoint, str(small_disk / "ckpts"))
    state = {"w": jax.random.normal(jax.random.key(0), (12 * 2**18,), jnp.float32)}  # 12 MiB: 2 fit, 3 do not
    with pytest.raises(CheckpointSaveError) as e:
        for step in range(1, 10):
            ckpt.save(step, state, {}, {})
    last = _steps(small_disk / "ckpts")[-1]
    assert last >= 2
    older = (f"steps {', '.join(map(str, range(1, last)))}", "are") if last > 2 else ("step 1", "is")
    assert re.search(rf"every checkpoint is kept \(max_num_checkpoints_to_keep=-1\); {older[0]} \(\d+\.\d MiB\) "
                     rf"{older[1]} older than step {last} and may be deleted to make room$", str(e.value)), str(e.value)
    ckpt.close()


def _start_and_wait_for_steps(out: Path, *args, steps=3, hold: tuple[str, Path] | None = None):
    """train.py saving to `out`/sub, once `steps` steps are in its metrics; `hold`: (function, file), held_before's."""
    cmd = [*TRAIN, "run_name=sub", f"base_output_directory={out}", "per_device_batch_size=1",
           "max_target_length=16", "base_num_decoder_layers=2", "steps=100000", *args]
    proc = subprocess.Popen(held_before(cmd, hold[0], when=hold[1]) if hold else cmd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "sub" / "metrics.jsonl"
    assert _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= steps, 240, 0.05)
    return proc


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_exits_130(tmp_path):
    proc = _start_and_wait_for_steps(tmp_path, "checkpoint_period=100000")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    _no_echoes(err)
    last = max(_losses(tmp_path / "sub"))
    assert f"stopped by SIGINT after step {last}; checkpoint" in err and (tmp_path / "sub" / "checkpoints" /
                                                                          str(last)).is_dir()
    again = _train(tmp_path, f"steps={last + 1}")
    assert again.returncode == 0 and f"resuming from step {last}" in again.stderr, again.stderr[-3000:]


def test_sigterm_before_the_first_step_is_one_line_and_exit_143(tmp_path):
    # after the config line, before the mesh, the state and the compile (held there: HELD_LINE)
    code, err = sigterm_after_line(held_before([*TRAIN, "run_name=sub", f"base_output_directory={tmp_path}", "steps=3"],
                                               "tessera.step.setup"), HELD_LINE)
    assert code == 143, err[-3000:]
    _no_echoes(err)
    assert "stopped by SIGTERM outside the training loop: no new checkpoint (exit code 143)" in err
    assert not (tmp_path / "sub" / "checkpoints").exists()


@pytest.mark.slow
def test_second_ctrl_c_stops_now_and_never_loads_a_half_written_save(tmp_path):
    """The second Ctrl-C comes while a save is in flight: its array files written, its folder still
    Orbax's temporary one, held just before its checksums are listed and it is committed (held_before,
    once the test has created the `hold` file; before, the test gave a 170 MB save 0.3 s and hoped)."""
    hold = tmp_path / "hold"
    proc = _start_and_wait_for_steps(tmp_path, "checkpoint_period=1",
                                     hold=("tessera.checkpointing.checksums.record", hold))
    hold.touch()  # the next save to finish writing is held before its commit
    proc.send_signal(signal.SIGINT)  # finish this step, save it and stop
    seen, waiting_for = [], {"SIGINT received: finishing", HELD_LINE}
    for line in proc.stderr:  # the first signal handled (two signals sent before that are one), and a save held
        seen.append(line)
        waiting_for = {text for text in waiting_for if text not in line}
        if not waiting_for:
            break
    assert not waiting_for, "".join(seen)[-3000:]
    proc.send_signal(signal.SIGINT)  # stop now
    start = time.time()
    _, rest = proc.communicate(timeout=120)
    err = "".join(seen) + rest
    assert proc.returncode == 130 and time.time() - start < 30, err[-3000:]
    _no_echoes(err)
    assert "SIGINT received again: stopping now" in err
    ckpt = tmp_path / "sub" / "checkpoints"
    complete = _steps(ckpt)
    partial = [p.name for p in ckpt.iterdir() if "orbax-checkpoint-tmp" in p.name]
    assert len(partial) == 1 and complete, (partial, complete)  # the held save, after at least one whole one
    again = _train(tmp_path, f"steps={complete[-1] + 1}")
    assert again.returncode == 0 and f"resuming from step {complete[-1]}" in again.stderr, again.stderr[-3000:]
    assert re.search(rf"incomplete checkpoint \S*{re.escape(partial[0])}", again.stderr), again.stderr[-3000:]


def test_train_compile_refuses_an_unwritable_report_folder_before_compiling(tmp_path, capsys):
    from tessera import train_compile

    (tmp_path / "file").write_text("")
    code = train_compile.main(["configs/base.yml", "compile_topology=v5e-4", "run_name=aot",
                               f"base_output_directory={tmp_path}/file"])
    assert code == 2
    assert (f"config error: the run folder {tmp_path}/file/aot (from base_output_directory) cannot be written: "
            f"{tmp_path}/file is a file" in capsys.readouterr().err)


def _convert(*args):
    return subprocess.run([TRAIN[0], "-m", "tessera.tools.convert", *args, "base_num_decoder_layers=2"],
                          capture_output=True, text=True, timeout=300, cwd=Path(TRAIN[1]).parent,
                          env={**os.environ, "PYTHONPATH": str(Path(TRAIN[1]).parent / "src"), "JAX_PLATFORMS": "cpu"})


def test_a_convert_output_folder_under_a_file_is_one_line_before_reading(tmp_path):
    """(A damaged checkpoint's one line: test_deleted_metadata_is_a_damaged_checkpoint_not_a_config_mismatch; a
    quiet round trip: test_readme_commands.)"""
    (tmp_path / "hf").mkdir()
    (tmp_path / "file").write_text("")
    proc = _convert("hf-to-tessera", str(tmp_path / "hf"), str(tmp_path / "file" / "out"))
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"error: output folder={tmp_path}/file/out cannot be written: {tmp_path}/file is a file"), proc.stderr


def test_a_sync_save_whose_checksum_list_cannot_be_written_is_set_aside(tmp_path, monkeypatch):
    """A full disk can leave room for the arrays but not for the list written after a sync save: that
    step is reported and set aside like any failed save, and the previous one stays the last."""
    import errno

    import jax.numpy as jnp
    from conftest import tiny_config

    from tessera.checkpointing import Checkpointer, CheckpointSaveError, checksums

    ckpt = Checkpointer(tiny_config(async_checkpointing=False).checkpoint, str(tmp_path / "ckpts"))
    state = {"w": jnp.arange(1000.0)}
    ckpt.save(1, state, {}, {})

    def full(folder, items_only):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checksums, "record", full)
    with pytest.raises(CheckpointSaveError) as e:
        ckpt.save(2, state, {}, {})
    assert str(e.value).startswith(f"saving checkpoint step 2 to {tmp_path / 'ckpts'} failed: No space left on device")
    assert f"The last complete checkpoint is step 1 ({tmp_path / 'ckpts' / '1'})" in str(e.value)
    assert _steps(tmp_path / "ckpts") == [1]
    assert [p.name.split(".")[0] for p in (tmp_path / "ckpts_incomplete").iterdir()] == ["2"]
    ckpt.close()
