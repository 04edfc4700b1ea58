"""multihost_runner.py: signals, interrupted copies, the clean-up command, the worker's folder and
up-front argument checks, against the fake `gcloud` of tests/fake_gcloud.py (see test_launchers.py)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO
from test_launchers import FROM_A_TERMINAL, add_nodes, calls, code_dir, fake, run  # noqa: F401  (fixtures)

RUNNER = REPO / "multihost_runner.py"


def start(*args: str, cwd: Path) -> subprocess.Popen:
    """The runner in a session of its own, so that a test's signal reaches it alone."""
    return subprocess.Popen([*FROM_A_TERMINAL, str(RUNNER), *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(condition, seconds: float = 60) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def assert_one_line_error(stderr: str, text: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("multihost_runner:")]
    assert len(lines) == 1 and text in lines[0], stderr


@pytest.mark.parametrize("sig,code,text", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                           (signal.SIGHUP, 129, "stopped by SIGHUP"),
                                           (signal.SIGINT, 130, "interrupted")])
def test_runner_signal_stops_every_gcloud_ssh_and_the_remote_command(fake, tmp_path, sig, code, text):
    """SIGTERM/SIGHUP (a closed terminal) left every `gcloud ssh` and remote command running, silently."""
    add_nodes(fake, ["pod-0", "pod-1"])
    for s in (0, 1):
        for w in (0, 1):
            (fake / "workers" / f"pod-{s}" / str(w) / "r").mkdir(parents=True)
    pid_files = [fake / "workers" / f"pod-{s}" / str(w) / "r" / "pid" for s in (0, 1) for w in (0, 1)]
    proc = start("--TPU_PREFIX=pod", "--COMMAND=echo $$ > pid.tmp && mv pid.tmp pid && exec sleep 61",
                 "--USE_EXISTING_FOLDER=true", "--RUN_NAME=r", cwd=tmp_path)
    pids = []
    try:
        wait_for(lambda: all(p.exists() for p in pid_files))
        pids = [int(p.read_text()) for p in pid_files]
        os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == code, stderr
        assert_one_line_error(stderr, text)
        wait_for(lambda: not any(map(alive, pids)), seconds=10)
    finally:
        for pid in pids:  # only the remote commands this test started, left running before the fix
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_runner_ctrl_c_while_copying_the_code_is_one_line(fake, code_dir, tmp_path):
    """Ctrl-C during a slow `tpu-vm scp` gave a KeyboardInterrupt traceback."""
    add_nodes(fake, ["solo"])
    slow = tmp_path / "slow_bin"
    slow.mkdir()
    (slow / "gcloud").write_text(  # the fake gcloud, with an scp that takes 60 s
        f"#!{sys.executable}\nimport os, sys, time\n"
        f"if 'scp' in sys.argv:\n    open({str(tmp_path / 'scp_started')!r}, 'w').close()\n    time.sleep(60)\n"
        f"os.execv({sys.executable!r}, [{sys.executable!r}, {str(REPO / 'tests' / 'fake_gcloud.py')!r}, "
        "*sys.argv[1:]])\n")
    (slow / "gcloud").chmod(0o755)
    os.environ["PATH"] = f"{slow}{os.pathsep}{os.environ['PATH']}"  # the `fake` fixture restores PATH
    proc = start("--TPU_PREFIX=solo", "--COMMAND=true", f"--SCRIPT_DIR={code_dir}", "--RUN_NAME=r", cwd=tmp_path)
    try:
        wait_for((tmp_path / "scp_started").exists)
        os.kill(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert_one_line_error(stderr, "interrupted")
    assert not [c for c in calls(fake) if c[3] == "ssh"]  # nothing unpacked or run


def documented_cleanup_commands() -> list[str]:
    texts = [(REPO / "getting_started" / "Run_on_TPU_VMs.md").read_text(), RUNNER.read_text()]
    found = [re.findall(r'--COMMAND="(pkill [^"]*)"', t) for t in texts]
    assert all(found), "the clean-up command is no longer in Run_on_TPU_VMs.md and the runner's docstring"
    return sorted({c for f in found for c in f})


@pytest.mark.parametrize("command", documented_cleanup_commands())
def test_runner_documented_cleanup_command_does_not_kill_its_own_shell(fake, tmp_path, command):
    """`pkill -f train.py || true` matched the remote shell running it: every worker 'failed' (143)."""
    assert "rain.py" in command
    script = f"rain_{uuid.uuid4().hex}.py"  # a name only this test's processes have: pkill kills nothing else
    command = command.replace("rain.py", script)
    add_nodes(fake, ["solo"])
    for w in (0, 1):
        (fake / "workers" / "solo" / str(w) / "r").mkdir(parents=True)
    train = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"t{script}"])
    try:
        proc = run("multihost_runner.py", "--TPU_PREFIX=solo", f"--COMMAND={command}", "--USE_EXISTING_FOLDER=true",
                   "--RUN_NAME=r", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert train.wait(timeout=10) == -signal.SIGTERM  # and it did stop the training
    finally:
        train.kill()
        train.wait()


@pytest.mark.parametrize("command", ["echo X || true", "true; echo X"])
def test_runner_failed_cd_fails_the_worker(fake, tmp_path, command):
    """`cd ~/typo && echo X || true` succeeded and `cd ~/typo && true; echo X` ran `echo X` in the home folder:
    the launcher said all workers finished."""
    add_nodes(fake, ["solo"], workers=1)
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", f"--COMMAND={command}", "--USE_EXISTING_FOLDER=true",
               "--RUN_NAME=typo", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "slice 0 worker 0 exited with code 1" in proc.stderr and "typo" in proc.stderr
    assert "X" not in (tmp_path / "logs" / "typo" / "slice0_worker0.log").read_text().split()


def test_runner_runs_all_of_the_command_in_the_folder(fake, tmp_path):
    """All of COMMAND runs in ~/<RUN_NAME>, a trailing `# comment` included (it must not hide the group's end)."""
    add_nodes(fake, ["solo"], workers=1)
    home = fake / "workers" / "solo" / "0"
    (home / "keep").mkdir(parents=True)
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=true; pwd  # where am I",
               "--USE_EXISTING_FOLDER=true", "--RUN_NAME=keep", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert str(home / "keep") in proc.stdout.splitlines() and str(home) not in proc.stdout.splitlines()


def test_runner_without_gcloud_on_path_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcloud here
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=true", cwd=tmp_path)
    assert proc.returncode == 1
    assert_one_line_error(proc.stderr, "`gcloud` is not on PATH")


def test_runner_log_dir_that_is_a_file_is_refused_before_copying(fake, code_dir, tmp_path):
    add_nodes(fake, ["solo"])
    (tmp_path / "notes").write_text("a file")
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=true", f"--SCRIPT_DIR={code_dir}",
               "--RUN_NAME=r", "--LOG_DIR=notes", cwd=tmp_path)
    assert proc.returncode == 2
    assert_one_line_error(proc.stderr, "--LOG_DIR=notes: cannot make the log folder")
    assert not [c for c in calls(fake) if c[3] in ("scp", "ssh")]


@pytest.mark.parametrize("command", ["", "  "])
def test_runner_refuses_an_empty_command(fake, tmp_path, command):
    add_nodes(fake, ["solo"])
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", f"--COMMAND={command}", cwd=tmp_path)
    assert proc.returncode == 2 and "--COMMAND is empty" in proc.stderr and "Traceback" not in proc.stderr
    assert not (fake / "calls.jsonl").exists()


DOCS_COMMAND = "bash setup.sh DEVICE=tpu && bash configs/tpu/v5p/128b.sh RUN_NAME=r1 OUTPUT_PATH=gs://{}/runs"


@pytest.mark.parametrize("flags, message", [
    # bash -n passed these (`<bucket` and `>/runs` are redirections): the code was copied, then every worker
    # failed with "bucket: No such file or directory"
    ([f"--COMMAND={DOCS_COMMAND.format('<bucket>')}"], "still holds <bucket>, a placeholder to fill in"),
    (["--COMMAND=bash train.sh RUN_NAME=<name> STEPS=5"], "still holds <name>, a placeholder to fill in"),
    (["--COMMAND=bash setup.sh 'DEVICE=tpu"], "is not a bash command (line 1: unexpected EOF"),
    (["--COMMAND=true", "--RUN_NAME=<name>"], "--RUN_NAME='<name>' still holds <name>, a placeholder"),  # so named
    (["--COMMAND=true", "--ZONE=<zone>"], "--ZONE='<zone>' still holds <zone>"),
    # looked up among the zone's TPU VMs, then exit 1 ("no TPU VM named ''")
    (["--COMMAND=true", "--TPU_PREFIX="], "--TPU_PREFIX='' cannot name a TPU VM"),
    (["--COMMAND=true", "--TPU_PREFIX= solo"], "--TPU_PREFIX=' solo' cannot name a TPU VM"),
    (["--COMMAND=true", "--TPU_PREFIX=My_TPU"], "--TPU_PREFIX='My_TPU' cannot name a TPU VM"),
])
def test_runner_refuses_a_command_every_worker_would_fail_on(fake, tmp_path, flags, message):
    add_nodes(fake, ["solo"])
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", *flags, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (fake / "calls.jsonl").exists()


def test_runner_runs_angle_brackets_that_are_no_placeholder(fake, tmp_path):
    add_nodes(fake, ["solo"])
    (tmp_path / "in").write_text("from a file\n")
    command = f"echo '<b>' \\<i\\> && cat < {tmp_path / 'in'}"  # quoted, escaped, a redirection with spaces
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", f"--COMMAND={command}", "--RUN_NAME=r1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "logs" / "r1" / "slice0_worker0.log").read_text()
    assert "<b> <i>" in log and "from a file" in log


def test_runner_refuses_a_missing_script_dir_before_any_gcloud_call(fake, tmp_path):
    """It listed the slices first, then stopped with exit code 1 (not the documented 2 for bad arguments)."""
    add_nodes(fake, ["solo"])
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=true", "--SCRIPT_DIR=my code", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "error: --SCRIPT_DIR=my code is not a folder; give the folder to copy to the workers (default: the current one)")
    assert not (fake / "calls.jsonl").exists()
    (tmp_path / "my code").mkdir()  # a relative folder with a space is copied as it is
    (tmp_path / "my code" / "hi.sh").write_text("echo hi from $FAKE_WORKER\n")
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=bash hi.sh", "--SCRIPT_DIR=my code",
               "--RUN_NAME=r1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "hi from 1" in (tmp_path / "logs" / "r1" / "slice0_worker1.log").read_text()
    assert (fake / "workers" / "solo" / "1" / "r1" / "hi.sh").is_file()


def test_runner_copies_output_that_is_not_utf8_and_does_not_hang(fake, code_dir, tmp_path):
    """A byte that is not UTF-8 in a worker's output killed the thread copying it (a traceback); the worker then
    blocked on the full pipe and the runner waited for ever."""
    add_nodes(fake, ["solo"], workers=1)
    command = ('printf "caf\\xe9\\n"; for i in $(seq 1 20000); do echo "line $i, enough to fill a pipe"; done; '
               'printf "last \\xff\\n"; exit 3')
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", f"--COMMAND={command}", f"--SCRIPT_DIR={code_dir}",
               "--RUN_NAME=r", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    log = (tmp_path / "logs" / "r" / "slice0_worker0.log").read_text(encoding="utf-8")
    assert log.startswith("caf\ufffd\n") and "line 20000, enough" in log and log.endswith("last \ufffd\n")
    assert "exited with code 3" in proc.stderr and "last \ufffd" in proc.stderr


@pytest.mark.parametrize("prefix,nodes", [
    ("pod", [{"name": "pod", "state": "CREATING"}]),  # ran on 0 workers and said all of them finished (exit 0)
    ("pod", [{"name": "pod-0", "state": "CREATING"},  # an IndexError traceback (no worker 0 for the coordinator)
             {"name": "pod-1", "state": "READY", "networkEndpoints": [{"ipAddress": "10.1.1.0"}]}]),
    ("pod", [{"name": "pod", "state": "STOPPED", "networkEndpoints": [{"ipAddress": "10.1.0.0"}]}]),
])
def test_runner_refuses_a_slice_that_is_not_ready(fake, tmp_path, prefix, nodes):
    """A slice still CREATING (just asked for, as in Run_on_TPU_VMs.md step 1) is listed with no workers."""
    fake.mkdir()
    (fake / "nodes.json").write_text(json.dumps([{**n, "name": f"projects/p/locations/z/nodes/{n['name']}"}
                                                 for n in nodes]))
    proc = run("multihost_runner.py", f"--TPU_PREFIX={prefix}", "--COMMAND=true", "--USE_EXISTING_FOLDER=true",
               "--RUN_NAME=r", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert_one_line_error(proc.stderr, "not ready: ")
    waiting = next(n for n in nodes if n["state"] != "READY")
    assert f"{waiting['name']} ({waiting['state']}, " in proc.stderr and "shows them READY" in proc.stderr
    assert not [c for c in calls(fake) if c[3] in ("scp", "ssh")]


def test_runner_does_not_ship_the_reference_environment(fake, code_dir, tmp_path):
    """.venv-hf (`setup.sh HF_REFERENCE=1`, PyTorch and transformers: 1.2 GB) was packed and copied to every worker."""
    add_nodes(fake, ["solo"], workers=1)
    (code_dir / ".venv-hf" / "lib").mkdir(parents=True)
    (code_dir / ".venv-hf" / "lib" / "torch.py").write_text("")
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=ls -a", f"--SCRIPT_DIR={code_dir}",
               "--RUN_NAME=r", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    shipped = fake / "workers" / "solo" / "0" / "r"
    assert (shipped / "hello.sh").is_file() and not (shipped / ".venv-hf").exists()


def test_runner_ctrl_c_while_a_worker_starts_stops_that_worker_too(fake, tmp_path, monkeypatch):
    """A Ctrl-C that landed while a worker was being started (Thread.start waits for the new thread) lost
    that worker: its `gcloud ssh` and the command on the TPU VM ran on (seen at every try with 32 workers)."""
    import importlib.util
    import threading
    spec = importlib.util.spec_from_file_location("runner_under_test", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    add_nodes(fake, ["solo"], workers=1)
    folder = fake / "workers" / "solo" / "0" / "r"
    folder.mkdir(parents=True)
    args = runner.parse_args(["--TPU_PREFIX=solo", "--COMMAND=echo $$ > pid.tmp && mv pid.tmp pid && exec sleep 61",
                              "--USE_EXISTING_FOLDER=true", "--RUN_NAME=r", f"--LOG_DIR={tmp_path / 'logs'}"])
    (tmp_path / "logs" / "r").mkdir(parents=True)

    class Thread(threading.Thread):
        def start(self):  # the user's Ctrl-C arrives here, once the worker's command runs
            wait_for((folder / "pid").exists)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # room for the handler to run inside this call, as it did
            super().start()

    monkeypatch.setattr(runner, "threading", type("threading", (), {"Thread": Thread}))
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    pid = None
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run_everywhere(args, runner.find_slices("solo", []), tmp_path / "logs" / "r")
        pid = int((folder / "pid").read_text())
        wait_for(lambda: not alive(pid), seconds=10)
    finally:
        for sig, handler in saved.items():  # run_everywhere ignores them for its clean-up
            signal.signal(sig, handler)
        if pid and alive(pid):  # left running before the fix
            os.kill(pid, signal.SIGKILL)


def test_packing_the_code_on_a_full_disk_is_one_line(code_dir):
    """A full temporary folder (the archive is written there before the copy) was an OSError traceback."""
    from tessera.tpu_vm import GcloudError, pack_code
    with pytest.raises(GcloudError, match=r"No space left on device; free some space in .* or set TMPDIR"):
        pack_code(code_dir, Path("/dev/full"))  # every write to it fails with ENOSPC


def test_runner_with_a_full_log_disk_keeps_reading_the_workers(fake, tmp_path):
    """A full disk under --LOG_DIR ended the thread copying a worker's output (a traceback); the worker then
    blocked on the full pipe and the runner waited for ever."""
    add_nodes(fake, ["solo"], workers=1)
    (fake / "workers" / "solo" / "0" / "r").mkdir(parents=True)
    command = 'for i in $(seq 1 20000); do echo "line $i, enough to fill a pipe"; done'
    # the runner may write 200 kB to a file; then a write fails, as on a full disk (EFBIG, not ENOSPC)
    limited = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)); "
               "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", limited, str(RUNNER), "--TPU_PREFIX=solo", f"--COMMAND={command}",
                           "--USE_EXISTING_FOLDER=true", "--RUN_NAME=r"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "line 20000, enough" in proc.stdout  # slice 0 worker 0 is still echoed, every line of it
    assert_one_line_error(proc.stderr, "slice0_worker0.log (File too large); slice 0 worker 0's output "
                                       "is no longer saved, it runs on")


def test_runner_keeps_the_logs_of_an_earlier_launch_with_the_same_run_name(fake, code_dir, tmp_path):
    """The clean-up command of the guide (--USE_EXISTING_FOLDER=true --RUN_NAME=<the failed run's>) overwrote
    the logs that said why the run failed."""
    add_nodes(fake, ["solo"], workers=2)
    # each worker fails once both have written their line: the first failure stops the others, and a worker
    # stopped before its echo left an empty log (the test failed now and then on a busy machine)
    both_wrote = "touch ../../wrote$FAKE_WORKER; until [ -e ../../wrote0 ] && [ -e ../../wrote1 ]; do sleep 0.05; done"
    failed = run("multihost_runner.py", "--TPU_PREFIX=solo",
                 f"--COMMAND=echo why it failed $FAKE_WORKER; {both_wrote}; exit 3", f"--SCRIPT_DIR={code_dir}",
                 "--RUN_NAME=r1", cwd=tmp_path)
    assert failed.returncode == 1
    cleanup = run("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=echo cleaned $FAKE_WORKER",
                  "--USE_EXISTING_FOLDER=true", "--RUN_NAME=r1", cwd=tmp_path)
    assert cleanup.returncode == 0, cleanup.stderr
    assert "the 2 log(s) of an earlier launch named r1 are kept" in cleanup.stdout
    logs = tmp_path / "logs" / "r1"
    for w in (0, 1):
        assert (logs / f"slice0_worker{w}.log").read_text() == f"cleaned {w}\n"
        kept = [f for f in logs.glob(f"slice0_worker{w}.*.log")]
        assert len(kept) == 1 and re.fullmatch(rf"slice0_worker{w}\.\d{{4}}(-\d\d){{5}}\.log", kept[0].name), kept
        assert kept[0].read_text() == f"why it failed {w}\n"


def test_runner_piped_into_head_does_not_hang(fake, tmp_path):
    """`multihost_runner.py ... | head`: the closed stdout ended the thread echoing slice 0 worker 0 with a
    BrokenPipeError; the worker then blocked on its full pipe (the job with it) and the runner waited for ever."""
    add_nodes(fake, ["solo"], workers=1)
    (fake / "workers" / "solo" / "0" / "r").mkdir(parents=True)
    command = 'for i in $(seq 1 20000); do echo "line $i, enough to fill a pipe"; done'
    proc = start("--TPU_PREFIX=solo", f"--COMMAND={command}", "--USE_EXISTING_FOLDER=true", "--RUN_NAME=r",
                 cwd=tmp_path)
    try:
        while "line 1," not in proc.stdout.readline():  # what `head` reads, then it goes away
            pass
        proc.stdout.close()
        assert proc.wait(timeout=60) == 0
        stderr = proc.stderr.read()
        assert "Traceback" not in stderr and "Broken pipe" not in stderr, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (tmp_path / "logs" / "r" / "slice0_worker0.log").read_text().endswith("line 20000, enough to fill a pipe\n")


def test_runner_under_nohup_survives_the_logout(fake, tmp_path):
    """`nohup python3 multihost_runner.py ... &`, then a logout: the runner replaced nohup's SIG_IGN with its own
    handler, so the SIGHUP stopped every worker (exit 129)."""
    add_nodes(fake, ["solo"], workers=1)
    folder = fake / "workers" / "solo" / "0" / "r"
    folder.mkdir(parents=True)
    proc = subprocess.Popen(["nohup", sys.executable, str(RUNNER), "--TPU_PREFIX=solo", "--USE_EXISTING_FOLDER=true",
                             "--COMMAND=touch started; sleep 3; echo finished", "--RUN_NAME=r"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for((folder / "started").exists)
        proc.send_signal(signal.SIGHUP)  # nohup execs the runner: the same process
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "SIGHUP" not in stderr, stderr
    assert "finished" in stdout


@pytest.mark.parametrize("command, ending", [
    # it read "slice 0 worker 1 exited with code -9"
    ('if [ "$FAKE_WORKER" = 1 ]; then kill -9 $PPID; exit; fi; sleep 30',
     "slice 0 worker 1 ended when its `gcloud ssh` on this machine was killed by SIGKILL"),
    ('if [ "$FAKE_WORKER" = 1 ]; then exit 255; fi; sleep 30',
     "slice 0 worker 1 exited with code 255, ssh's code for a connection that failed or dropped"),
    # a peer's death ends a JAX job with SIGABRT (getting_started/Multi_process.md); it read "exited with code 134"
    ('if [ "$FAKE_WORKER" = 1 ]; then sh -c \'kill -ABRT $$\'; exit $?; fi; sleep 30',
     "slice 0 worker 1 exited with code 134 (128 + 6: stopped by SIGABRT; JAX's runtime after a peer process died"),
    ('if [ "$FAKE_WORKER" = 1 ]; then exit 7; fi; sleep 30', "slice 0 worker 1 exited with code 7 (log"),
])
def test_runner_says_how_a_worker_ended(fake, tmp_path, command, ending):
    add_nodes(fake, ["solo"])
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", f"--COMMAND={command}", "--RUN_NAME=r1", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "multihost_runner: 1 worker(s) failed:" in proc.stderr and ending in proc.stderr


def test_runner_folders_under_the_home_folder_as_typed(fake, code_dir, tmp_path):
    """`--LOG_DIR=~/logs` is passed as typed (bash expands ~ after `NAME=`, not after `--NAME=`): the logs went to
    a folder named '~' in the current one, and `--SCRIPT_DIR=~/code` was refused as "not a folder"."""
    add_nodes(fake, ["solo"])
    home = tmp_path / "home"
    (home / "code").mkdir(parents=True)
    (home / "code" / "hi.sh").write_text("echo hi from $FAKE_WORKER\n")
    work = tmp_path / "work"
    work.mkdir()
    proc = run("multihost_runner.py", "--TPU_PREFIX=solo", "--COMMAND=bash hi.sh", "--SCRIPT_DIR=~/code",
               "--LOG_DIR=~/logs", "--RUN_NAME=r1", cwd=work, env={"HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    assert (home / "logs" / "r1" / "slice0_worker1.log").read_text() == "hi from 1\n"
    assert not (work / "~").exists()
