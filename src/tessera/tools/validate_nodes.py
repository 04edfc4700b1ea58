"""How the validation suite (`tessera.tools.validate`) runs its training job: the nodes' commands
(`validate_commands`: here or over ssh, in a container when the file names an image) started, each
streaming to its own log; and how it follows them (node 0's progress as a bar on a terminal, else
as a line every PROGRESS_SECONDS)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tessera.tools.cli import Heartbeat
from tessera.tools.validate_commands import environment_here

PROGRESS_SECONDS = 30.0
KILL_AFTER_SECONDS = 60.0  # after --timeout's SIGTERM, how long the nodes may take to save and stop before SIGKILL


class NodesStopped(Exception):
    """SIGTERM, SIGINT or SIGHUP reached the suite: every node was given it (SIGHUP as SIGTERM) and has exited."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class NodesTimedOut(Exception):
    """The nodes ran longer than the suite's --timeout: they were stopped, and `codes` are their exit codes."""

    def __init__(self, seconds: float, codes: list[int]):
        super().__init__(f"timed out after {seconds:g} s (--timeout)")
        self.seconds, self.codes = seconds, codes


def _say(line: str) -> None:
    """`line` on stderr from the --timeout watcher's thread: a closed stderr (`2>&1 | head`) ended the thread with
    a traceback before its SIGKILL, and a node that ignored SIGTERM (hung in a collective) kept the suite waiting."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


class _RunningNodes:
    """The nodes' processes and logs, and the signals passed on to them: by `forward` (SIGTERM, SIGINT
    or SIGHUP to the suite) and by the `--timeout` watcher, which may both write to an ssh relay."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        self.received: list[int] = []
        self.timed_out = False
        self.done = threading.Event()
        self.sending = threading.RLock()
        self.watcher = threading.Thread(target=self.stop_at_timeout, name="tessera-validate-timeout", daemon=True)

    def start(self, rank: int, host: str, argv, env, log_path: Path) -> None:
        self.logs.append(log_path.open("w"))
        full_env = {**environment_here(), **env} if host == "local" else dict(os.environ)
        self.procs.append(subprocess.Popen(argv, env=full_env, stdout=self.logs[-1], stderr=subprocess.STDOUT,
                                           stdin=None if host == "local" else subprocess.PIPE, start_new_session=True))
        print(f"node {rank} ({host}) started; log {log_path}", flush=True)

    def running(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is None]

    def send(self, signum: int) -> int:
        """`signum` to every running node once; how many were running."""
        running = self.running()
        with self.sending:
            for p in running:
                if p.stdin is None and signum == signal.SIGKILL:  # its whole session: the trainer's children too
                    try:
                        os.killpg(p.pid, signum)
                    except ProcessLookupError:
                        pass
                elif p.stdin is None:
                    p.send_signal(signum)
                else:
                    try:  # a node over ssh: its relay passes the signal on (RELAY)
                        p.stdin.write(f"{signal.Signals(signum).name.removeprefix('SIG')}\n".encode())
                        p.stdin.flush()
                    except OSError:  # its ssh has just ended
                        pass
        return len(running)

    def forward(self, signum, frame) -> None:
        """SIGTERM or SIGINT to the suite, passed on to every node; SIGHUP (the terminal or the ssh session of
        the suite closed) as SIGTERM, which a trainer saves and stops on. Sent before anything is printed: after
        a hang-up, writing to the terminal fails."""
        self.received.append(signum)
        passed = signal.SIGTERM if signum == signal.SIGHUP else signum
        count = self.send(passed)
        as_what = "" if passed == signum else f" as {signal.Signals(passed).name}"
        try:
            print(f"{signal.Signals(signum).name} received: passed on{as_what} to the {count} running node(s), "
                  "which save and stop (a second signal stops them at once); waiting for them",
                  file=sys.stderr, flush=True)
        except OSError:  # a terminal that hung up
            pass

    def stop_at_timeout(self) -> None:
        if self.done.wait(self.timeout):
            return
        self.timed_out = True
        _say(f"timeout: the nodes have run for {self.timeout:g} s (--timeout); SIGTERM passed on to the "
             f"{self.send(signal.SIGTERM)} running node(s), which save and stop; SIGKILL in {KILL_AFTER_SECONDS:g} s")
        if self.done.wait(KILL_AFTER_SECONDS):
            return
        _say(f"timeout: SIGKILL to the {self.send(signal.SIGKILL)} node(s) still running")
        if not self.done.wait(10.0):  # an ssh whose connection hangs cannot pass the signal on: end it here
            for p in self.running():
                p.kill()

    def stop(self) -> None:
        """SIGTERM to every running node (each saves and stops), SIGKILL KILL_AFTER_SECONDS later to any still
        running; returns once every node has exited."""
        self.send(signal.SIGTERM)
        deadline = time.monotonic() + KILL_AFTER_SECONDS
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if self.send(signal.SIGKILL):
            for p in self.procs:
                try:
                    p.wait(10.0)
                except subprocess.TimeoutExpired:  # an ssh whose connection hangs: end it here
                    p.kill()
                    p.wait()

    def close(self) -> None:
        self.done.set()
        if self.watcher.is_alive():
            self.watcher.join()
        for log in self.logs:
            log.close()
        for p in self.procs:
            if p.stdin and p.poll() is not None:
                p.stdin.close()


def run_nodes(commands, log_dir: Path, steps: str, timeout: float = 0.0) -> list[int]:
    """Start every node's command, stream each to its own log file, wait for all. The nodes run in
    sessions of their own, and SIGTERM or SIGINT (Ctrl-C) to the suite is passed on to each of them
    once, SIGHUP as SIGTERM unless it is ignored (a trainer saves and stops; a second signal stops it at
    once): a scheduler's SIGTERM to the suite alone left its trainers running without a parent, and a
    signal to the whole process group reached every trainer twice. Once they have exited, NodesStopped. With `timeout` > 0, nodes still
    running that many seconds after the start get SIGTERM, then SIGKILL KILL_AFTER_SECONDS later
    (a hung node blocked the suite forever); once they have exited, NodesTimedOut."""
    log_dir.mkdir(parents=True, exist_ok=True)
    nodes = _RunningNodes(timeout)
    # SIGHUP too (a closed terminal or ssh session): it ended the suite alone and left every local trainer
    # running without it; one ignored (`nohup`) stays ignored, so that the run outlives the session
    stops = [signal.SIGTERM, signal.SIGINT] + [signal.SIGHUP] * (signal.getsignal(signal.SIGHUP) != signal.SIG_IGN)
    previous = {s: signal.signal(s, nodes.forward) for s in stops}
    try:
        for rank, (host, argv, env) in enumerate(commands):
            if nodes.received:  # a signal while the nodes start: the ones started after it never got it and waited
                break  # for the stopped ones (a multi-node job's initialization timeout, 30 min in AMD's files)
            nodes.start(rank, host, argv, env, log_dir / f"node{rank}.log")
        if timeout > 0:
            nodes.watcher.start()
        codes = wait_for_nodes(nodes.procs, log_dir / "node0.log", steps)
    except BaseException:  # e.g. stdout closed (`| head`) at "node 0 started": the nodes trained on without the suite
        nodes.stop()
        raise
    finally:
        nodes.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if nodes.received:
        raise NodesStopped(nodes.received[0])
    if nodes.timed_out:
        raise NodesTimedOut(timeout, codes)
    return codes


def wait_for_nodes(procs: list[subprocess.Popen], node0_log: Path, steps: str) -> list[int]:
    """Exit codes of every node; meanwhile the steps node 0 has logged, as a bar on a terminal,
    else in a line every PROGRESS_SECONDS."""
    if sys.stdout.isatty():
        from tqdm import tqdm

        total = int(steps) if steps.isdigit() else None
        with tqdm(total=total, unit="step", desc="training (node 0)", file=sys.stdout) as bar:
            while any(p.poll() is None for p in procs):
                bar.update(max(0, last_step_logged(node0_log) - bar.n))
                time.sleep(1.0)
            bar.update(max(0, last_step_logged(node0_log) - bar.n))
    else:
        def detail() -> str:
            running = sum(p.poll() is None for p in procs)
            return f"step {last_step_logged(node0_log)}/{steps} on node 0, {running} of {len(procs)} node(s) running"

        closed: list[BrokenPipeError] = []

        def emit(line: str) -> None:  # in the heartbeat's thread, where a closed stdout (`| head`) was a traceback
            try:  # and the nodes trained on to the end: the main thread raises it, and run_nodes stops them
                print(line, flush=True)
            except BrokenPipeError as e:
                closed.append(e)

        with Heartbeat("training", PROGRESS_SECONDS, detail, emit=emit):
            while any(p.poll() is None for p in procs) and not closed:
                time.sleep(0.2)
        if closed:
            raise closed[0]
    return [p.wait() for p in procs]


def last_step_logged(log_file: Path, tail_bytes: int = 65536) -> int:
    """The last step line (`step   100 | loss ...`) in the end of a trainer's log; 0 before the first."""
    try:
        with log_file.open("rb") as f:
            f.seek(max(0, log_file.stat().st_size - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return 0
    steps = re.findall(r"\bstep\s+(\d+) \| loss", text)
    return int(steps[-1]) if steps else 0
