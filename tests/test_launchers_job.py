"""multihost_job.py's ways out against the fake `gcloud`: stop signals, a queued resource lost after
ACTIVE, an earlier run's files, bucket names and paths, and bad arguments: each ends with one line,
a documented exit code and no traceback, and deletes the queued resource once it may exist."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from test_launchers import FROM_A_TERMINAL, JOB_ARGS, calls, code_dir, fake, run  # noqa: F401 (fixtures)

# worker 1 of the one slice dies before uploading its status: the launcher keeps waiting for it
KILL_WORKER_1 = 'if [ "$TESSERA_HOST" = job1-w1 ]; then kill -9 $PPID; fi; true'


def deletes(state: Path) -> list[list[str]]:
    return [c for c in calls(state) if c[3:5] == ["queued-resources", "delete"]]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([*FROM_A_TERMINAL, str(REPO / "multihost_job.py"), *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for_call(state: Path, words: list[str], proc: subprocess.Popen, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        if (state / "calls.jsonl").exists() and any(c[:len(words)] == words or c[3:3 + len(words)] == words
                                                    for c in calls(state)):
            return
        time.sleep(0.05)
    raise AssertionError(f"no gcloud {words} call while the launcher ran; calls: {calls(state)}")


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        try:  # the fake's orphaned start-up scripts, in the launcher's own session
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return proc.returncode, out, err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_job_stop_signal_while_waiting_deletes_the_queued_resource(fake, code_dir, tmp_path, signum):
    proc = start([*JOB_ARGS, f"--COMMAND={KILL_WORKER_1}", f"--SCRIPT_DIR={code_dir}"], tmp_path)
    wait_for_call(fake, ["storage", "ls", "gs://bkt/tessera-jobs/job1/status/"], proc)
    proc.send_signal(signum)
    code, out, err = finish(proc)
    assert code == 128 + signum, err
    assert err.strip() == f"multihost_job: stopped by {signal.Signals(signum).name}" and "Traceback" not in err
    assert deletes(fake) == [["alpha", "compute", "tpus", "queued-resources", "delete", "job1", "--force", "--quiet",
                              "--async", "--zone=z1"]]
    assert "deleting queued resource job1" in out


def test_job_ctrl_c_during_create_deletes_the_queued_resource(fake, code_dir, tmp_path):
    """The fake's create runs the start-up scripts before it returns: `sleep` keeps it busy."""
    proc = start([*JOB_ARGS, "--COMMAND=sleep 8", f"--SCRIPT_DIR={code_dir}"], tmp_path)
    wait_for_call(fake, ["queued-resources", "create"], proc)
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc)
    assert code == 130 and err.strip() == "multihost_job: stopped by SIGINT", err
    assert len(deletes(fake)) == 1


def test_job_stop_signal_before_create_deletes_nothing(fake, code_dir, tmp_path):
    """A wrapper makes the upload slow; a SIGTERM during it ends the launcher before any create."""
    fake.mkdir(exist_ok=True)
    write_wrapper('if [ "$1" = storage ] && [ "$2" = cp ]; then touch "$FAKE_GCLOUD_DIR/uploading"; sleep 5; fi')
    proc = start([*JOB_ARGS, "--COMMAND=true", f"--SCRIPT_DIR={code_dir}"], tmp_path)
    end = time.monotonic() + 60
    while not (fake / "uploading").exists() and time.monotonic() < end and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == 143 and err.strip() == "multihost_job: stopped by SIGTERM; nothing was created", err
    assert [c[:2] for c in calls(fake)] == [["storage", "ls"]]  # neither create nor delete (the upload never ran)


def write_wrapper(prelude: str) -> None:
    """Replace the test's gcloud wrapper (first on PATH) by one that runs `prelude` before the fake."""
    gcloud = Path(os.environ["PATH"].split(os.pathsep)[0]) / "gcloud"
    gcloud.write_text(f'#!/bin/sh\n{prelude}\nexec "{sys.executable}" "{REPO / "tests" / "fake_gcloud.py"}" "$@"\n')


@pytest.fixture
def scripted_qr_states(fake, tmp_path):
    """Replace the test's gcloud wrapper by one that answers each `queued-resources describe` with the next
    line of <state>/qr_states (the last line repeats): the fake alone cannot change state after ACTIVE."""
    write_wrapper('''f="$FAKE_GCLOUD_DIR/qr_states"
if [ "$5" = describe ] && [ -s "$f" ]; then
  FAKE_GCLOUD_QR_STATE="$(head -n 1 "$f")"; export FAKE_GCLOUD_QR_STATE
  if [ "$(wc -l < "$f")" -gt 1 ]; then sed -i 1d "$f"; fi
fi''')
    fake.mkdir(exist_ok=True)
    return fake / "qr_states"


@pytest.mark.parametrize("lost", ["SUSPENDED", "FAILED"])
def test_job_notices_a_queued_resource_lost_after_active(fake, code_dir, tmp_path, scripted_qr_states, lost):
    """A --spot slice preempted after ACTIVE, with a worker that never reports: the launcher waited forever
    (here until --TIMEOUT_MINUTES) instead of failing on the queued resource's state."""
    scripted_qr_states.write_text(f"ACTIVE\nACTIVE\n{lost}\n")
    proc = run("multihost_job.py", *JOB_ARGS, "--TIMEOUT_MINUTES=0.2", f"--COMMAND={KILL_WORKER_1}",
               f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert f"queued resource job1 is {lost} after it was ACTIVE" in proc.stderr and "1 of 2" in proc.stderr
    assert "Traceback" not in proc.stderr and len(deletes(fake)) == 1


def test_job_hears_from_a_worker_that_restarted_before_its_command_finished(fake, code_dir, tmp_path):
    """Worker 1's VM dies in the middle of the command and boots again (a crash, host maintenance): the
    start-up script runs again at boot, found the job started, and exited without a word, so the launcher
    waited for that worker forever (here until --TIMEOUT_MINUTES). It now reports code 1 with a log line."""
    proc = start([*JOB_ARGS, "--TIMEOUT_MINUTES=0.3", f"--COMMAND={KILL_WORKER_1}", f"--SCRIPT_DIR={code_dir}"],
                 tmp_path)
    wait_for_call(fake, ["storage", "ls", "gs://bkt/tessera-jobs/job1/status/"], proc)
    create = next(c for c in calls(fake) if c[3:5] == ["queued-resources", "create"])
    script = next(a for a in create if a.startswith("--metadata-from-file=")).split("=", 2)[2]
    home = fake / "workers" / "job1" / "1"
    for _ in range(2):  # the boot after the crash reports it; a later boot does nothing
        subprocess.run(["bash", script], cwd=home, env={**os.environ, "HOME": str(home), "TESSERA_HOST": "job1-w1"},
                       check=True, timeout=60)
    code, out, err = finish(proc)
    assert code == 1 and "Traceback" not in err, err
    assert "multihost_job: worker job1-w1 exited with code 1; log gs://bkt/tessera-jobs/job1/logs/job1-w1.log" in err
    assert "1 of 2 worker(s) succeeded" in out and len(deletes(fake)) == 1
    log = (fake / "gcs" / "bkt" / "tessera-jobs" / "job1" / "logs" / "job1-w1.log").read_text()
    assert log.endswith("tessera job job1: this worker restarted before the command finished; it is not run again\n")


def test_job_refuses_a_run_folder_with_an_earlier_runs_status(fake, code_dir, tmp_path):
    status = fake / "gcs" / "bkt" / "tessera-jobs" / "job1" / "status"
    status.mkdir(parents=True)
    for host in ("old-w0", "old-w1", "old-w2"):
        (status / host).write_text("3\n")
    proc = run("multihost_job.py", *JOB_ARGS, "--COMMAND=true", f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "gs://bkt/tessera-jobs/job1/ already holds status/ of an earlier run" in proc.stderr
    assert "--RUN_NAME" in proc.stderr and "gcloud storage rm -r gs://bkt/tessera-jobs/job1/" in proc.stderr
    assert [c[:2] for c in calls(fake)] == [["storage", "ls"]]  # nothing uploaded (its code stays) or created
    assert (status / "old-w0").read_text() == "3\n"  # the earlier run's files are left alone


def test_job_second_run_with_the_same_name_is_refused(fake, code_dir, tmp_path):
    first = run("multihost_job.py", *JOB_ARGS, "--COMMAND=true", f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = run("multihost_job.py", *JOB_ARGS, "--COMMAND=true", f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert again.returncode == 1 and "already holds logs/ and status/ of an earlier run" in again.stderr


def test_job_bucket_dir_with_a_space_reaches_the_workers(fake, code_dir, tmp_path):
    """RUN_URL was unquoted in the start-up script: the workers never reported and the launcher waited."""
    proc = run("multihost_job.py", *JOB_ARGS, "--BUCKET_DIR=my runs", "--TIMEOUT_MINUTES=0.1", "--COMMAND=true",
               f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    logs = fake / "gcs" / "bkt" / "my runs" / "job1" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["job1-w0.log", "job1-w1.log"]


@pytest.mark.parametrize("bucket", ["My-Bucket", "bkt/dir", "ab", "b" * 64, "-bkt", "bkt.", "b kt"])
def test_job_refuses_a_bad_bucket_name_before_uploading(fake, code_dir, tmp_path, bucket):
    args = [a for a in JOB_ARGS if not a.startswith("--BUCKET_NAME")]
    proc = run("multihost_job.py", *args, f"--BUCKET_NAME={bucket}", "--COMMAND=true", f"--SCRIPT_DIR={code_dir}",
               cwd=tmp_path)
    assert proc.returncode == 2 and f"--BUCKET_NAME={bucket!r} is not a GCS bucket name" in proc.stderr
    assert not (fake / "calls.jsonl").exists()


def test_job_without_gcloud_on_path_says_so(code_dir, tmp_path):
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    proc = run("multihost_job.py", *JOB_ARGS, "--COMMAND=true", f"--SCRIPT_DIR={code_dir}", cwd=tmp_path,
               env={"PATH": str(empty)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("multihost_job: no `gcloud` on PATH")


@pytest.mark.parametrize("flag, message", [
    ("--CQR_EXTRA_ARGS=--network='mtu9k", "cannot be split into flags (No closing quotation)"),
    ("--POLL_SECONDS=inf", "--POLL_SECONDS=inf must be above 0"),
    ("--TIMEOUT_MINUTES=nan", "both finite"),
    ("--COMMAND= ", "--COMMAND is empty"),  # created the slices, ran nothing there and reported success
    ("--TPU_TYPE=", "--TPU_TYPE is empty; e.g. --TPU_TYPE=v5p-256"),
    # gcloud refused these only after the code had been uploaded (exit 1)
    ("--TPU_TYPE=v5p", "--TPU_TYPE='v5p' is not an accelerator type"),
    ("--TPU_TYPE=V5P_256", "--TPU_TYPE='V5P_256' is not an accelerator type"),
    ("--TPU_TYPE=v2-alpha-tpuv5", "is not an accelerator type"),  # the runtime version in its place
    ("--TPU_TYPE=<changeme>", "--TPU_TYPE='<changeme>' still holds <changeme>, a placeholder to fill in"),
    ("--VERSION=V2-ALPHA-TPUV5", "--VERSION='V2-ALPHA-TPUV5' is not a TPU VM runtime version"),
    ("--BUCKET_DIR=<folder>/jobs", "--BUCKET_DIR='<folder>/jobs' still holds <folder>"),  # was made, so named
    ("--CQR_EXTRA_ARGS=--network=<network>", "still holds <network>, a placeholder"),
    ("--VERSION=v2 alpha", "is not a TPU VM runtime version"),
    # bash on every worker refused these, once the slices had been made and had booted
    ("--COMMAND=bash configs/tpu/v5p/128b.sh OUTPUT_PATH=<changeme>", "is not a bash command (line 1: syntax error"),
    ("--COMMAND=bash setup.sh 'DEVICE=tpu", "is not a bash command (line 1: unexpected EOF"),
    # bash -n passed these (redirections from the file `bucket`, to the file `/runs`); every worker failed on them
    ("--COMMAND=bash configs/tpu/v5p/128b.sh RUN_NAME=r1 OUTPUT_PATH=gs://<bucket>/runs PLATFORM=gce",
     "still holds <bucket>, a placeholder to fill in"),
    ('--COMMAND=bash configs/tpu/v5p/128b.sh OUTPUT_PATH="gs://<changeme>/runs"', "still holds <changeme>"),
])
def test_job_refuses_bad_flags_before_uploading(fake, code_dir, tmp_path, flag, message):
    proc = run("multihost_job.py", *JOB_ARGS, "--COMMAND=true", f"--SCRIPT_DIR={code_dir}", flag, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (fake / "calls.jsonl").exists()


def test_job_refuses_a_missing_script_dir_before_any_gcloud_call(fake, tmp_path):
    """It listed the bucket first, then stopped with exit code 1 (not the documented 2 for bad arguments)."""
    proc = run("multihost_job.py", *JOB_ARGS, "--COMMAND=true", "--SCRIPT_DIR=no such dir", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "error: --SCRIPT_DIR=no such dir is not a folder; give the folder to ship to the workers (default: the "
        "current one)")
    assert not (fake / "calls.jsonl").exists()


@pytest.mark.parametrize("bucket_dir, folder", [("runs/", "gs://bkt/runs/job1"), ("/a/b/", "gs://bkt/a/b/job1"),
                                                ("", "gs://bkt/job1")])
def test_job_bucket_dir_slashes_make_no_empty_folder(fake, code_dir, tmp_path, bucket_dir, folder):
    """--BUCKET_DIR=runs/ uploaded to gs://bkt/runs//job1/ (an empty folder name in every object's path)."""
    proc = run("multihost_job.py", *JOB_ARGS, f"--BUCKET_DIR={bucket_dir}", "--TIMEOUT_MINUTES=0.1",
               "--COMMAND=true", f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"logs in {folder}/logs/" in proc.stdout
    assert ["storage", "cp", str(Path(tempfile_dir(fake)) / "code.tar.gz"), f"{folder}/code.tar.gz"] in calls(fake)


def tempfile_dir(state: Path) -> str:
    """The launcher's temporary folder, from its upload call."""
    upload = next(c for c in calls(state) if c[:2] == ["storage", "cp"] and c[-1].endswith("/code.tar.gz"))
    return str(Path(upload[2]).parent)


def test_job_piped_into_head_still_deletes_the_queued_resource(fake, code_dir, tmp_path):
    """`multihost_job.py ... | head -1`: the next line raised BrokenPipeError, a traceback that skipped the delete
    and left the slices running (and paid for)."""
    proc = start([*JOB_ARGS, "--COMMAND=true", f"--SCRIPT_DIR={code_dir}"], cwd=tmp_path)
    proc.stdout.readline()  # what `head -1` reads ("queued resource job1 created: ..."), then it goes away
    proc.stdout.close()
    try:
        assert proc.wait(timeout=60) == 0
        stderr = proc.stderr.read()
    finally:
        finish(proc)
    assert "Traceback" not in stderr and "Broken pipe" not in stderr, stderr
    assert len(deletes(fake)) == 1


def test_job_under_nohup_survives_the_logout(fake, code_dir, tmp_path):
    """`nohup python3 multihost_job.py ... &`, then a logout: the launcher replaced nohup's SIG_IGN with its own
    handler, so the SIGHUP deleted the queued resource (exit 129) of a job meant to outlive the session."""
    proc = subprocess.Popen(["nohup", sys.executable, str(REPO / "multihost_job.py"), *JOB_ARGS, "--TIMEOUT_MINUTES=0.1",
                             f"--COMMAND={KILL_WORKER_1}", f"--SCRIPT_DIR={code_dir}"], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    wait_for_call(fake, ["storage", "ls", "gs://bkt/tessera-jobs/job1/status/"], proc)
    proc.send_signal(signal.SIGHUP)  # nohup execs the launcher: the same process
    code, out, err = finish(proc)
    assert code == 1 and "SIGHUP" not in err, err
    assert "--TIMEOUT_MINUTES=0.1 passed before the job finished" in err  # it waited on, as asked


@pytest.mark.parametrize("tpu_type, version", [("tpu7x-16", "tpu-vm-tf-2.16.1-pjrt"),
                                               ("v5litepod-256 ", " v2-alpha-tpuv5-lite")])
def test_job_takes_the_accelerator_types_and_runtime_versions_gcloud_takes(fake, code_dir, tmp_path, tpu_type, version):
    proc = run("multihost_job.py", *JOB_ARGS, f"--TPU_TYPE={tpu_type}", f"--VERSION={version}", "--COMMAND=true",
               f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    create = next(c for c in calls(fake) if c[4:5] == ["create"])
    assert f"--accelerator-type={tpu_type.strip()}" in create and f"--runtime-version={version.strip()}" in create


def test_job_script_dir_under_the_home_folder_as_typed(fake, code_dir, tmp_path):
    """`--SCRIPT_DIR=~/code` reaches the launcher as typed: it was refused as "not a folder"."""
    proc = run("multihost_job.py", *JOB_ARGS, "--COMMAND=bash hello.sh", "--SCRIPT_DIR=~/code", cwd=tmp_path,
               env={"HOME": str(code_dir.parent)})
    assert proc.returncode == 0, proc.stderr
    assert "hello from" in (fake / "gcs" / "bkt" / "tessera-jobs" / "job1" / "logs" / "job1-w0.log").read_text()


def test_job_names_the_signal_that_stopped_a_worker(fake, code_dir, tmp_path):
    """It read "worker job1-w1 exited with code 137", the code of a command the OOM killer ended."""
    command = 'if [ "$TESSERA_HOST" = job1-w1 ]; then sh -c \'kill -KILL $$\'; fi'
    proc = run("multihost_job.py", *JOB_ARGS, f"--COMMAND={command}", f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ("multihost_job: worker job1-w1 exited with code 137 (128 + 9: stopped by SIGKILL; the kernel's "
            "out-of-memory killer, or kill -9); log gs://bkt/tessera-jobs/job1/logs/job1-w1.log") in proc.stderr
