"""multihost_runner.py and multihost_job.py against a fake `gcloud` first on PATH.

The fake (tests/fake_gcloud.py) records every call and runs worker commands locally, so these
tests check the exact gcloud commands, that the code arrives on every worker, that every
worker runs the command, and that failures are reported with the failing worker named.
"""

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """PATH with the fake gcloud first; returns the fake's state folder."""
    bin_dir, state = tmp_path / "bin", tmp_path / "gcloud_state"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO / "tests" / "fake_gcloud.py"}" "$@"\n')
    gcloud.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GCLOUD_DIR", str(state))
    return state


def add_nodes(state: Path, names: list[str], workers: int = 2) -> None:
    state.mkdir(exist_ok=True)
    nodes = [{"name": f"projects/p/locations/z/nodes/{n}",
              "networkEndpoints": [{"ipAddress": f"10.1.{i}.{w}"} for w in range(workers)]}
             for i, n in enumerate(names)]
    (state / "nodes.json").write_text(json.dumps(nodes))


def calls(state: Path) -> list[list[str]]:
    return [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]


# A launcher started as from a terminal's shell: the stop signals handled by default and none blocked. A test
# process may have inherited SIGHUP ignored (a CI job started under nohup: a SIGHUP sent by the test then
# went unheard), and the launchers keep an ignored signal ignored on purpose (`nohup ... &` must outlive the
# terminal).
FROM_A_TERMINAL = [sys.executable, "-c", "import os, signal, sys\n"
                   "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP): signal.signal(s, signal.SIG_DFL)\n"
                   "signal.pthread_sigmask(signal.SIG_SETMASK, [])\n"
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]


def run(script: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*FROM_A_TERMINAL, str(REPO / script), *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


@pytest.fixture
def code_dir(tmp_path):
    code = tmp_path / "code"
    (code / ".git").mkdir(parents=True)
    (code / ".git" / "HEAD").write_text("ref")
    (code / "hello.sh").write_text("echo hello from $FAKE_SLICE/$FAKE_WORKER\n")
    return code


def test_runner_copies_code_and_runs_on_every_worker_of_every_slice(fake, code_dir, tmp_path):
    add_nodes(fake, ["pod-0", "pod-1"])
    proc = run("multihost_runner.py", "--TPU_PREFIX=pod", "--COMMAND=bash hello.sh", f"--SCRIPT_DIR={code_dir}",
               "--RUN_NAME=r1", "--ZONE=us-east5-a", "--PROJECT=proj", "--LOG_DIR=logs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for s in (0, 1):
        for w in (0, 1):
            home = fake / "workers" / f"pod-{s}" / str(w)
            assert (home / "r1" / "hello.sh").is_file() and not (home / "r1" / ".git").exists()
            log = (tmp_path / "logs" / "r1" / f"slice{s}_worker{w}.log").read_text()
            assert f"hello from pod-{s}/{w}" in log
    assert "hello from pod-0/0" in proc.stdout  # slice 0 worker 0 is echoed
    scope = ["--project=proj", "--zone=us-east5-a"]
    recorded = calls(fake)
    assert recorded[0] == ["compute", "tpus", "tpu-vm", "list", "--format=json", *scope]
    assert ["compute", "tpus", "tpu-vm", "scp", str(Path(tempfile_name(recorded))), "pod-1:", "--worker=all",
            *scope] in recorded
    runs = sorted(c for c in recorded if c[3] == "ssh" and c[5] != "--worker=all")
    assert len(runs) == 4
    expected = ("export MEGASCALE_COORDINATOR_ADDRESS=10.1.0.0:8080 MEGASCALE_NUM_SLICES=2 MEGASCALE_SLICE_ID=1 "
                "MEGASCALE_PORT=8080; cd ~/r1 && { bash hello.sh\n}")  # grouped: a failed cd fails the worker
    assert runs[-1] == ["compute", "tpus", "tpu-vm", "ssh", "pod-1", "--worker=1", *scope, f"--command={expected}"]


def tempfile_name(recorded: list[list[str]]) -> str:
    return next(c[4] for c in recorded if c[3] == "scp")


def test_runner_names_the_failed_worker_and_exits_nonzero(fake, code_dir, tmp_path):
    add_nodes(fake, ["solo"], workers=3)
    command = 'if [ "$FAKE_WORKER" = 2 ]; then echo disk full >&2; exit 7; fi; sleep 30'
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", f"--COMMAND={command}", f"--SCRIPT_DIR={code_dir}",
               "--RUN_NAME=r2", "--INTERNAL_IP=true", cwd=tmp_path)
    assert proc.returncode == 1
    assert "slice 0 worker 2 exited with code 7" in proc.stderr and "disk full" in proc.stderr
    assert "worker 0 exited" not in proc.stderr  # stopped, not failed
    single_slice = [c for c in calls(fake) if c[3] == "ssh" and c[5] == "--worker=2"][0]
    assert "--internal-ip" in single_slice and "MEGASCALE" not in single_slice[-1]


def test_runner_existing_folder_skips_the_copy(fake, code_dir, tmp_path):
    add_nodes(fake, ["solo"], workers=1)
    (fake / "workers" / "solo" / "0" / "keep").mkdir(parents=True)
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=pwd", "--USE_EXISTING_FOLDER=true",
               "--RUN_NAME=keep", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not [c for c in calls(fake) if c[3] == "scp"]
    needs_name = run("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=pwd", "--USE_EXISTING_FOLDER=true",
                     cwd=tmp_path)
    assert needs_name.returncode == 2 and "--RUN_NAME" in needs_name.stderr


def test_runner_reports_unknown_slices_and_gcloud_failures(fake, code_dir, tmp_path):
    add_nodes(fake, ["other"])
    proc = run("multihost_runner.py", "--TPU_PREFIX=pod", "--COMMAND=true", cwd=tmp_path)
    assert proc.returncode == 1 and "no TPU VM named 'pod'" in proc.stderr and "other" in proc.stderr
    add_nodes(fake, ["pod"])
    proc = run("multihost_runner.py", "--TPU_PREFIX=pod", "--COMMAND=true", f"--SCRIPT_DIR={code_dir}",
               cwd=tmp_path, env={"FAKE_GCLOUD_FAIL_ON": "scp"})
    assert proc.returncode == 1 and "tpu-vm scp" in proc.stderr and "injected failure" in proc.stderr


JOB_ARGS = ["--TPU_TYPE=v5p-16", "--VERSION=v2-alpha-tpuv5", "--RUN_NAME=job1", "--BUCKET_NAME=bkt",
            "--ZONE=z1", "--POLL_SECONDS=0.01", "--CQR_EXTRA_ARGS=--network=mtu9k --spot"]


def test_job_creates_queued_resource_collects_logs_and_cleans_up(fake, code_dir, tmp_path):
    proc = run("multihost_job.py", "--NUM_SLICES=2", *JOB_ARGS, "--COMMAND=bash hello.sh; echo $TESSERA_HOST",
               f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    recorded = calls(fake)
    assert recorded[0] == ["storage", "ls", "gs://bkt/tessera-jobs/job1/"]  # an earlier run's folder is refused first
    assert recorded[1][:3] == ["storage", "cp", recorded[1][2]] and recorded[1][3] == "gs://bkt/tessera-jobs/job1/code.tar.gz"
    create = next(c for c in recorded if c[3:5] == ["queued-resources", "create"])
    script = next(a for a in create if a.startswith("--metadata-from-file=startup-script="))
    assert create == ["alpha", "compute", "tpus", "queued-resources", "create", "job1", "--node-count=2",
                      "--node-prefix=job1", "--accelerator-type=v5p-16", "--runtime-version=v2-alpha-tpuv5", script,
                      "--zone=z1", "--network=mtu9k", "--spot"]
    logs = fake / "gcs" / "bkt" / "tessera-jobs" / "job1" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [f"job1-{s}-w{w}.log" for s in (0, 1) for w in (0, 1)]
    assert "job1-1-w0" in (logs / "job1-1-w0.log").read_text()
    assert recorded[-1] == ["alpha", "compute", "tpus", "queued-resources", "delete", "job1", "--force", "--quiet",
                            "--async", "--zone=z1"]


def test_job_names_failed_workers_and_still_cleans_up(fake, code_dir, tmp_path):
    command = 'test "$TESSERA_HOST" != job1-w1 || exit 5'
    proc = run("multihost_job.py", *JOB_ARGS, f"--COMMAND={command}", f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert proc.returncode == 1
    assert "worker job1-w1 exited with code 5" in proc.stderr and "job1-w0" not in proc.stderr
    assert "--node-id=job1" in next(c for c in calls(fake) if c[3:5] == ["queued-resources", "create"])
    assert calls(fake)[-1][4] == "delete"


def test_job_failed_queued_resource_is_deleted(fake, code_dir, tmp_path):
    proc = run("multihost_job.py", *JOB_ARGS, "--COMMAND=true", f"--SCRIPT_DIR={code_dir}", cwd=tmp_path,
               env={"FAKE_GCLOUD_QR_STATE": "FAILED"})
    assert proc.returncode == 1 and "queued resource job1 is FAILED" in proc.stderr
    assert calls(fake)[-1][4] == "delete"
    bad = run("multihost_job.py", *JOB_ARGS[:3], "--BUCKET_NAME=gs://bkt", "--COMMAND=true", cwd=tmp_path)
    assert bad.returncode == 2 and "without gs://" in bad.stderr


@pytest.mark.parametrize("name", ["My_Run", "1run", "run-", "r 1", "r1;rm", "a" * 62])
def test_job_refuses_a_run_name_google_cloud_would_refuse_before_uploading(fake, code_dir, tmp_path, name):
    """--RUN_NAME names the queued resource and its slices (and, unquoted, the workers' folder): gcloud refused
    such a name only after the code was packed and uploaded; with two slices the last is <name>-1."""
    args = [a for a in JOB_ARGS if not a.startswith("--RUN_NAME")]
    proc = run("multihost_job.py", "--NUM_SLICES=2", *args, f"--RUN_NAME={name}", "--COMMAND=true",
               f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert proc.returncode == 2 and f"--RUN_NAME={name!r} names the queued resource and its slices" in proc.stderr
    assert not (fake / "calls.jsonl").exists()  # nothing uploaded, nothing created
    ok = run("multihost_job.py", "--NUM_SLICES=2", *args, f"--RUN_NAME={'a' * 61}", "--COMMAND=true",
             f"--SCRIPT_DIR={code_dir}", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("name", ["..", ".", "a/b", " r1"])
def test_runner_refuses_a_run_name_that_is_not_one_folder_name(fake, code_dir, tmp_path, name):
    """The code is unpacked into ~/<RUN_NAME> on every worker: --RUN_NAME=.. unpacked it into /home."""
    add_nodes(fake, ["solo"], workers=1)
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=true", f"--SCRIPT_DIR={code_dir}",
               f"--RUN_NAME={name}", cwd=tmp_path)
    assert proc.returncode == 2 and f"--RUN_NAME={name!r} must be one folder name" in proc.stderr
    assert not (fake / "calls.jsonl").exists()


def test_the_guides_launcher_commands_pass_the_launchers_checks():
    """The checks made before any gcloud call (placeholders, names, types) accept the commands the guide prints."""
    text = (REPO / "getting_started" / "Run_on_TPU_VMs.md").read_text()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", text, flags=re.S)).replace("\\\n", " ")
    commands = [shlex.split(line) for line in blocks.splitlines() if line.startswith("python3 multihost_")]
    assert [argv[1] for argv in commands] == ["multihost_runner.py", "multihost_job.py"]
    # and the clean-up command of the runner's section
    cleanup = re.search(r"`(--USE_EXISTING_FOLDER=true --RUN_NAME=r1 --COMMAND=.*?)`\n", text).group(1)
    commands.append(["python3", "multihost_runner.py", "--TPU_PREFIX=my-tpu", *shlex.split(cleanup)])
    for argv in commands:
        check = ("import sys; sys.path.insert(0, '.'); import importlib; "
                 f"print(importlib.import_module({argv[1][:-3]!r}).parse_args(sys.argv[1:]))")
        proc = subprocess.run([sys.executable, "-c", check, *argv[2:]], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, f"{shlex.join(argv)}: {proc.stderr}"


def old_python(version: str) -> str | None:
    """A working interpreter of `version` ("3.8"): on PATH, or in pyenv's folder (where this repo's machines keep
    them); None when this machine has none."""
    found = [shutil.which(f"python{version}") or ""]
    found += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
    for path in filter(None, found):
        if subprocess.run([path, "-c", "pass"], capture_output=True).returncode == 0:
            return path
    return None


def test_launchers_run_on_the_oldest_python_they_promise(fake, code_dir, tmp_path):
    """The guides run them with a workstation's python3. On 3.8 a --COMMAND that bash cannot parse ended in an
    AttributeError (str.removeprefix is 3.9's); on 3.7 a failed gcloud call did (shlex.join is 3.8's)."""
    python = old_python("3.8")
    if python is None:
        pytest.skip("no Python 3.8 on this machine (PATH or ~/.pyenv/versions)")
    add_nodes(fake, ["solo"])
    launch = lambda script, *args: subprocess.run(  # noqa: E731
        [python, str(REPO / script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    proc = launch("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=bash hello.sh", f"--SCRIPT_DIR={code_dir}",
                  "--RUN_NAME=r1")
    assert proc.returncode == 0 and "hello from solo/0" in proc.stdout, proc.stderr
    proc = launch("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=bash 'hello.sh")
    assert proc.returncode == 2 and "is not a bash command" in proc.stderr and "Traceback" not in proc.stderr
    proc = launch("multihost_job.py", *JOB_ARGS, "--COMMAND=true", f"--SCRIPT_DIR={code_dir}")
    assert proc.returncode == 0, proc.stderr
    older = old_python("3.7")
    if older:
        proc = subprocess.run([older, str(REPO / "multihost_job.py"), *JOB_ARGS, "--RUN_NAME=j2", "--COMMAND=true"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert proc.stderr.startswith("multihost_job: needs Python 3.8 or newer, this is 3.7.")
