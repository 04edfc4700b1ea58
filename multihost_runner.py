"""Run one command on every worker of one or more TPU VM slices, over `gcloud`.

    python3 multihost_runner.py --TPU_PREFIX=my-tpu \
        --COMMAND="bash setup.sh DEVICE=tpu && bash configs/tpu/v5p/128b.sh RUN_NAME=r1 OUTPUT_PATH=gs://b/runs"

`--TPU_PREFIX` names one slice, or several slices `<prefix>-0`, `<prefix>-1`, ... that train
together over DCN (the runner then sets the MEGASCALE_* variables libtpu uses to join them).
Steps: find the slices (`gcloud compute tpus tpu-vm list`), copy `--SCRIPT_DIR` to
`~/<RUN_NAME>` on every worker (`scp` + `tar`; skipped with `--USE_EXISTING_FOLDER=true`),
run `--COMMAND` there on all workers at once (`ssh --worker=<i>`), and stream each worker's
output to `<LOG_DIR>/<RUN_NAME>/slice<s>_worker<w>.log` (slice 0 worker 0 is echoed here too; an earlier
launch's logs there are renamed slice<s>_worker<w>.<time>.log).
When a worker fails the others are stopped, the failed ones are named with the end of their
logs, and the exit code is 1. Stopping the local `gcloud ssh` may leave a remote process
running; clean up with e.g. `--USE_EXISTING_FOLDER=true --RUN_NAME=r1 --COMMAND="pkill -f '[t]rain.py' || true"`
(the brackets keep the pattern from matching the remote shell that runs it, whose command line holds it).

--COMMAND is checked first: one that bash cannot parse (`bash -n`) or that still holds a <placeholder>
(gs://<bucket>/runs) is refused before any gcloud call; every worker would fail on it.

Exit codes: 0 every worker finished; 1 a gcloud call or a worker failed (or `gcloud` is not on PATH, or
this Python is older than 3.8);
2 bad arguments; 130 / 143 / 129 stopped by Ctrl-C / SIGTERM / SIGHUP (the local `gcloud` processes are
stopped first). A signal ignored when the runner starts stays ignored: `nohup python3 multihost_runner.py ... &`
outlives the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # works without `pip install -e .`

from tessera.tpu_vm import (MIN_PYTHON, GcloudError, Slice, command_problem, exit_description,  # noqa: E402
                            find_slices, gcloud, out, pack_code, parse_bool, placeholder_flag, scope_flags)

MEGASCALE_PORT = 8080
TPU_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # Google Cloud's resource names (RFC 1035 labels)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """SIGTERM or SIGHUP arrived: clean up like Ctrl-C, then exit with 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--TPU_PREFIX", required=True, help="TPU VM name, or prefix of slices <prefix>-0, <prefix>-1, ...")
    p.add_argument("--COMMAND", required=True, help="shell command run in the code folder on every worker")
    p.add_argument("--SCRIPT_DIR", default=".", help="local folder copied to the workers (default: .)")
    p.add_argument("--RUN_NAME", default="", help="folder name on the workers and for the logs "
                   "(default: <user>-<date>-<time>; required with --USE_EXISTING_FOLDER)")
    p.add_argument("--INTERNAL_IP", default="false", help="true: reach workers on their internal IPs "
                   "(when running from a VM in the same network)")
    p.add_argument("--USE_EXISTING_FOLDER", default="false", help="true: skip the copy and use ~/<RUN_NAME> as it is")
    p.add_argument("--PROJECT", default="", help="GCP project (default: gcloud's configured one)")
    p.add_argument("--ZONE", default="", help="zone (default: gcloud's configured one)")
    p.add_argument("--LOG_DIR", default="logs", help="local folder for the per-worker logs (default: logs)")
    args = p.parse_args(argv)
    left = placeholder_flag(args, ("TPU_PREFIX", "SCRIPT_DIR", "RUN_NAME", "PROJECT", "ZONE", "LOG_DIR"))
    if left:  # --RUN_NAME=<name> made folders named so on every worker and here
        p.error(left)
    if not TPU_NAME.fullmatch(args.TPU_PREFIX):  # '' or ' my-tpu' were looked up among the zone's TPU VMs
        p.error(f"--TPU_PREFIX={args.TPU_PREFIX!r} cannot name a TPU VM: Google Cloud names are lowercase letters, "
                "digits and hyphens, starting with a letter; e.g. --TPU_PREFIX=my-tpu (for my-tpu, or my-tpu-0, "
                "my-tpu-1, ...)")
    # `--LOG_DIR=~/logs` reaches us as typed (a shell expands ~ at the start of a word or after `NAME=`, not after
    # `--NAME=`): the logs went to a folder named '~' here, and --SCRIPT_DIR=~/code was "not a folder"
    args.SCRIPT_DIR, args.LOG_DIR = os.path.expanduser(args.SCRIPT_DIR), os.path.expanduser(args.LOG_DIR)
    if not args.COMMAND.strip():
        p.error("--COMMAND is empty: give the shell command to run on every worker, e.g. --COMMAND='bash setup.sh'")
    problem = command_problem(args.COMMAND)
    if problem:  # found before the code is copied, not by every worker's bash
        p.error(f"--COMMAND={args.COMMAND!r} {problem}")
    try:
        args.INTERNAL_IP = parse_bool(args.INTERNAL_IP)
        args.USE_EXISTING_FOLDER = parse_bool(args.USE_EXISTING_FOLDER)
    except ValueError as e:
        p.error(f"--INTERNAL_IP/--USE_EXISTING_FOLDER: {e}")
    if not args.USE_EXISTING_FOLDER and not os.path.isdir(args.SCRIPT_DIR):  # before any gcloud call
        p.error(f"--SCRIPT_DIR={args.SCRIPT_DIR} is not a folder; give the folder to copy to the workers "
                "(default: the current one)")
    if args.USE_EXISTING_FOLDER and not args.RUN_NAME:
        p.error("--USE_EXISTING_FOLDER=true needs --RUN_NAME: the folder ~/<RUN_NAME> to run in")
    name = args.RUN_NAME
    if name and (name in (".", "..") or "/" in name or name != name.strip()):
        p.error(f"--RUN_NAME={name!r} must be one folder name (the code goes to ~/<RUN_NAME> on every worker and "
                "the logs to <LOG_DIR>/<RUN_NAME>): no '/', not '.' or '..', no spaces around it; e.g. --RUN_NAME=r1")
    args.RUN_NAME = args.RUN_NAME or f"{getpass.getuser()}-{time.strftime('%Y-%m-%d-%H-%M-%S')}"
    return args


def ssh_base(args: argparse.Namespace, slice_name: str, worker: str) -> list[str]:
    flags = scope_flags(args.PROJECT, args.ZONE) + (["--internal-ip"] if args.INTERNAL_IP else [])
    return ["compute", "tpus", "tpu-vm", "ssh", slice_name, f"--worker={worker}", *flags]


def copy_code(args: argparse.Namespace, slices: list[Slice]) -> None:
    """Pack SCRIPT_DIR once, copy it to every worker and unpack it into ~/<RUN_NAME>."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = pack_code(Path(args.SCRIPT_DIR), Path(tmp) / f"{args.RUN_NAME}.tar.gz")
        flags = scope_flags(args.PROJECT, args.ZONE) + (["--internal-ip"] if args.INTERNAL_IP else [])
        for s in slices:
            out(f"copying {args.SCRIPT_DIR} to the {s.num_workers} worker(s) of {s.name}")
            gcloud(["compute", "tpus", "tpu-vm", "scp", str(archive), f"{s.name}:", "--worker=all", *flags])
            unpack = (f"mkdir -p ~/{shlex.quote(args.RUN_NAME)} && tar xzf ~/{shlex.quote(archive.name)} "
                      f"-C ~/{shlex.quote(args.RUN_NAME)}")
            gcloud([*ssh_base(args, s.name, "all"), f"--command={unpack}"])


def worker_command(args: argparse.Namespace, slices: list[Slice], slice_id: int) -> str:
    """The command for every worker of slice `slice_id`: multi-slice variables, folder, COMMAND."""
    env = ""
    if len(slices) > 1:
        coordinator = slices[0].internal_ips[0]
        env = (f"export MEGASCALE_COORDINATOR_ADDRESS={coordinator}:{MEGASCALE_PORT} "
               f"MEGASCALE_NUM_SLICES={len(slices)} MEGASCALE_SLICE_ID={slice_id} MEGASCALE_PORT={MEGASCALE_PORT}; ")
    # Grouped, so that a failed `cd` fails the worker (even with `COMMAND || true`) and all of COMMAND runs in
    # the folder; the newline before `}` ends a trailing `# comment` in COMMAND.
    return f"{env}cd ~/{shlex.quote(args.RUN_NAME)} && {{ {args.COMMAND}\n}}"


class Worker:
    """One `gcloud ... ssh --worker=<w>` process whose output goes to a log file (and maybe here)."""

    def __init__(self, slice_id: int, worker: int, argv: list[str], log_path: Path, echo: bool):
        self.slice_id, self.worker, self.log_path = slice_id, worker, log_path
        # A session of its own: stopping the worker signals gcloud and the ssh it started.
        # errors="replace": one byte that is not UTF-8 stopped the copy, and the worker then blocked on a full pipe
        self.proc = subprocess.Popen(["gcloud", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     encoding="utf-8", errors="replace", start_new_session=True)
        self.pump = threading.Thread(target=self._copy_output, args=(echo,), daemon=True)
        self.pump.start()

    def _copy_output(self, echo: bool) -> None:
        """Every line to the log (and here with `echo`), until the worker ends. A line that cannot be written
        (a full disk under --LOG_DIR; a closed stdout, see `out`) ended this thread with a traceback, and the
        worker then blocked on the full pipe for ever; now the log stops, with a line, and the worker runs on."""
        log = None
        try:
            log = self.log_path.open("w", encoding="utf-8")
        except OSError as e:
            _say(f"cannot write {self.log_path} ({e.strerror}); {self.label}'s output is not saved")
        for line in self.proc.stdout:
            if echo:
                out(line, end="")
            if log is not None:
                try:
                    log.write(line)
                    log.flush()
                except OSError as e:
                    log = _close(log)
                    _say(f"cannot write {self.log_path} ({e.strerror}); {self.label}'s output is no longer saved, "
                         "it runs on")
        _close(log)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.pump.join(timeout=10)

    @property
    def label(self) -> str:
        return f"slice {self.slice_id} worker {self.worker}"

    @property
    def ending(self) -> str:
        """How the worker's `gcloud ssh` ended, in words: a signal here read "exited with code -9"."""
        code = self.proc.returncode
        if code < 0:
            return (f"ended when its `gcloud ssh` on this machine was killed by {signal.Signals(-code).name} (the "
                    "command on the worker may run on)")
        if code == 255:  # ssh's own code
            return ("exited with code 255, ssh's code for a connection that failed or dropped (the worker restarted "
                    "or cannot be reached), unless the command itself exited with 255")
        return exit_description(code)

    def tail(self, lines: int = 5) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines() \
            if self.log_path.exists() else []
        return "\n".join("      " + line for line in text[-lines:])


def _say(message: str) -> None:
    try:
        print(f"multihost_runner: {message}", file=sys.stderr, flush=True)
    except OSError:  # stderr closed too
        pass


def _close(log) -> None:
    try:
        if log is not None:
            log.close()
    except OSError:  # the flush of what could not be written fails again
        pass


@contextlib.contextmanager
def signals_held():
    """Hold Ctrl-C, SIGTERM and SIGHUP inside the block, then deliver the first that came. One that arrived
    while a worker started (Popen waits for the exec, Thread.start for the thread) lost that worker: its
    `gcloud ssh` and the command on the TPU VM ran on after the runner said it had stopped them."""
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in STOP_SIGNALS
                if signal.getsignal(sig) is not signal.SIG_IGN}  # one that `nohup` (or `&`) ignores stays ignored
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:
        signal.raise_signal(held[0])


def run_everywhere(args: argparse.Namespace, slices: list[Slice], log_dir: Path) -> list[Worker]:
    """Start COMMAND on all workers, wait; on the first failure stop the others. Returns failures."""
    workers = []
    try:
        for s_id, s in enumerate(slices):
            command = worker_command(args, slices, s_id)
            for w in range(s.num_workers):
                argv = [*ssh_base(args, s.name, str(w)), f"--command={command}"]
                with signals_held():  # in the list before a Ctrl-C can end the loop: stopped with the others
                    workers.append(Worker(s_id, w, argv, log_dir / f"slice{s_id}_worker{w}.log",
                                          echo=(s_id, w) == (0, 0)))
        out(f"running on {len(workers)} worker(s); logs in {log_dir}/")
        return wait_all(workers)
    except (KeyboardInterrupt, Stopped):  # the workers run in sessions of their own and saw no signal
        for sig in STOP_SIGNALS:  # a second signal must not cut the clean-up
            signal.signal(sig, signal.SIG_IGN)
        for w in workers:
            w.stop()
        raise


def wait_all(workers: list[Worker]) -> list[Worker]:
    """Wait for every worker; after the first failure stop the rest. Returns the failed ones."""
    failed: list[Worker] = []
    running = list(workers)
    while running:
        for w in list(running):
            if w.proc.poll() is not None:
                running.remove(w)
                w.pump.join()
                if w.proc.returncode:
                    failed.append(w)
        if failed and running:
            print(f"stopping the {len(running)} worker(s) still running", file=sys.stderr, flush=True)
            for w in running:
                w.stop()
            break
        time.sleep(0.1)
    return failed


def main(argv: list[str]) -> int:
    if sys.version_info < MIN_PYTHON:  # 3.7 ended in an AttributeError (shlex.join) at the first failed gcloud call
        print(f"multihost_runner: needs Python {'.'.join(map(str, MIN_PYTHON))} or newer, this is "
              f"{sys.version.split()[0]}; run it with python3.8 or a newer python3 (any, without Tessera's packages)",
              file=sys.stderr)
        return 1
    args = parse_args(argv)
    if shutil.which("gcloud") is None:
        print("multihost_runner: `gcloud` is not on PATH; install the Google Cloud CLI "
              "(https://cloud.google.com/sdk/docs/install) or add its bin folder to PATH", file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGHUP):  # handled like Ctrl-C: stop the workers' gcloud, then exit
        if signal.getsignal(sig) is not signal.SIG_IGN:  # `nohup` ignores SIGHUP: the logout must not stop the run
            signal.signal(sig, _raise_stopped)
    try:
        return launch(args)
    except KeyboardInterrupt:
        print("multihost_runner: interrupted; the local gcloud processes were stopped", file=sys.stderr)
        return 130
    except Stopped as e:
        print(f"multihost_runner: stopped by {e}; the local gcloud processes were stopped", file=sys.stderr)
        return e.exit_code


def keep_earlier_logs(log_dir: Path) -> None:
    """Rename the logs of an earlier launch with this RUN_NAME to slice<s>_worker<w>.<time of its last line>.log.
    They were overwritten: the clean-up command of the guide, run with the failed run's RUN_NAME, emptied the
    logs that said why it failed."""
    earlier = sorted(f for f in log_dir.glob("slice*_worker*.log") if re.fullmatch(r"slice\d+_worker\d+\.log", f.name))
    for log in earlier:
        stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.localtime(log.stat().st_mtime))
        target, n = log.with_name(f"{log.stem}.{stamp}.log"), 1
        while target.exists():
            target, n = log.with_name(f"{log.stem}.{stamp}-{n}.log"), n + 1
        log.rename(target)
    if earlier:
        out(f"the {len(earlier)} log(s) of an earlier launch named {log_dir.name} are kept in {log_dir}/ as "
            "slice<s>_worker<w>.<time of their last line>.log")


def launch(args: argparse.Namespace) -> int:
    """Find the slices, make the log folder, copy the code, run COMMAND everywhere; returns the exit code."""
    log_dir = Path(args.LOG_DIR) / args.RUN_NAME
    try:
        slices = find_slices(args.TPU_PREFIX, scope_flags(args.PROJECT, args.ZONE))
        out(f"{len(slices)} slice(s): " + ", ".join(f"{s.name} ({s.num_workers} workers)" for s in slices))
    except GcloudError as e:
        print(f"multihost_runner: {e}", file=sys.stderr)
        return 1
    try:  # before the copy, which can take minutes
        log_dir.mkdir(parents=True, exist_ok=True)
        keep_earlier_logs(log_dir)
    except OSError as e:
        print(f"multihost_runner: --LOG_DIR={args.LOG_DIR}: cannot make the log folder {log_dir} "
              f"({e.strerror}); pass a folder (it is created if missing)", file=sys.stderr)
        return 2
    try:
        if not args.USE_EXISTING_FOLDER:
            copy_code(args, slices)
    except GcloudError as e:
        print(f"multihost_runner: {e}", file=sys.stderr)
        return 1
    failed = run_everywhere(args, slices, log_dir)
    if failed:
        print(f"multihost_runner: {len(failed)} worker(s) failed:", file=sys.stderr)
        for w in failed:
            print(f"  {w.label} {w.ending} (log {w.log_path}):\n{w.tail()}", file=sys.stderr)
        return 1
    out(f"multihost_runner: all workers finished; logs in {Path(args.LOG_DIR) / args.RUN_NAME}/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
