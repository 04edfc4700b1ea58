"""Run a command as a job on fresh TPU slices from a queued resource, then clean up.

    python3 multihost_job.py --NUM_SLICES=2 --TPU_TYPE=v5p-256 --VERSION=v2-alpha-tpuv5 \
        --RUN_NAME=r1 --BUCKET_NAME=my-bucket \
        --COMMAND="bash setup.sh DEVICE=tpu && bash configs/tpu/v5p/128b.sh RUN_NAME=r1 OUTPUT_PATH=gs://my-bucket/runs"

Steps, all through `gcloud`:
1. pack `--SCRIPT_DIR` and upload it to gs://<BUCKET_NAME>/<BUCKET_DIR>/<RUN_NAME>/code.tar.gz;
2. create the queued resource <RUN_NAME> (`--NUM_SLICES` slices of `--TPU_TYPE`) with a start-up
   script: every worker downloads the code, runs `--COMMAND` in it, and uploads its log to
   .../logs/<host>.log and its exit code to .../status/<host>;
3. wait until the slices are ACTIVE and every worker has reported (or `--TIMEOUT_MINUTES`);
4. delete the queued resource (also on failure, timeout, Ctrl-C, SIGTERM or SIGHUP) and exit 1 if
   any worker failed, naming it. `--CQR_EXTRA_ARGS` is appended to the create command (e.g. `--network=mtu9k`).

--COMMAND is checked first: one that bash cannot parse (`bash -n`: an unclosed quote) or that still holds a
<placeholder> (gs://<bucket>/runs) is refused before anything is uploaded; every worker would fail on it.
A run folder that already holds status/ or logs/ (an earlier run with the same --RUN_NAME) is
refused before anything is uploaded or created: its old exit codes would be counted as this run's.
While waiting for the workers the queued resource is described every poll: if it leaves ACTIVE
(e.g. a --spot slice preempted: SUSPENDING/SUSPENDED) the job fails instead of waiting forever.
A worker whose VM restarts while the command runs (a crash, host maintenance) does not run it again:
its start-up script reports exit code 1, with a line at the end of its log. A worker that stays down
without uploading its status while its slice stays ACTIVE is not noticed: set --TIMEOUT_MINUTES for that.

Exit codes: 0 every worker succeeded; 1 a worker failed, a gcloud command failed, the queued resource
failed or was suspended, the run folder already exists, --TIMEOUT_MINUTES passed, gcloud is not
on PATH or this Python is older than 3.8; 2 bad arguments; 128 + the signal's number when stopped by a signal (Ctrl-C 130, SIGTERM
143, SIGHUP 129), after deleting the queued resource if it may have been created. A signal ignored when
the launcher starts stays ignored: `nohup python3 multihost_job.py ... &` outlives the terminal.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # works without `pip install -e .`

from tessera.tpu_vm import (MIN_PYTHON, GcloudError, command_problem, describe_slice,  # noqa: E402
                            exit_description, gcloud, out, pack_code, placeholder_flag, scope_flags)

FAILED_STATES = {"FAILED", "SUSPENDED", "SUSPENDING"}
# once ACTIVE, these mean the slices are gone (preempted, failed or deleted) and no more workers will report
LOST_STATES = FAILED_STATES | {"DELETING"}
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# GCS bucket names: 3-63 lowercase letters, digits, '-', '_', '.', starting and ending with a letter or digit
BUCKET_NAME = re.compile(r"[a-z0-9][-_.a-z0-9]{1,61}[a-z0-9]")
# Google Cloud's resource names (RFC 1035 labels): the queued resource and its slices are named after --RUN_NAME,
# which the start-up script also uses, unquoted, as a folder name
RESOURCE_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# what `queued-resources create` takes: an accelerator type is a generation and a size (v5p-256, v5litepod-16,
# v6e-8, tpu7x-16); a runtime version lowercase words (v2-alpha-tpuv5, tpu-ubuntu2204-base, tpu-vm-tf-2.16.1-pjrt)
TPU_TYPE = re.compile(r"[a-z][a-z0-9]*-[1-9][0-9]*")
RUNTIME_VERSION = re.compile(r"[a-z0-9][-a-z0-9._]*")

STARTUP_SCRIPT = """#!/bin/bash
# Start-up script of Tessera job {run}: runs on every worker of every slice at boot.
RUN_URL={run_url}
HOST=${{TESSERA_HOST:-$(hostname)}}
WORK_DIR=${{HOME:-/root}}/{run}
if [ -e "$WORK_DIR/.started" ]; then  # a reboot does not start the job again...
  cd "$WORK_DIR" || exit 0
  [ -e .reported ] && exit 0
  if [ ! -s exit_code ]; then  # ...but reports a command cut short by it, or the launcher waits for this worker forever
    echo "tessera job {run}: this worker restarted before the command finished; it is not run again" >> job.log
    echo 1 > exit_code
  fi
else
  mkdir -p "$WORK_DIR" && cd "$WORK_DIR" && touch .started
  {{
    gcloud storage cp "$RUN_URL/code.tar.gz" . && tar xzf code.tar.gz && rm code.tar.gz && bash -c {command}
  }} > job.log 2>&1
  echo $? > exit_code
fi
gcloud storage cp job.log "$RUN_URL/logs/$HOST.log"
gcloud storage cp exit_code "$RUN_URL/status/$HOST" && touch .reported
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--NUM_SLICES", type=int, default=1, help="number of slices (default 1)")
    p.add_argument("--TPU_TYPE", required=True, help="accelerator type of each slice, e.g. v5p-256, v5litepod-256")
    p.add_argument("--VERSION", required=True, help="TPU VM runtime version, e.g. v2-alpha-tpuv5")
    p.add_argument("--RUN_NAME", required=True, help="name of the queued resource, its slices and the bucket folder")
    p.add_argument("--BUCKET_NAME", required=True, help="GCS bucket for the code, logs and exit codes (no gs://)")
    p.add_argument("--BUCKET_DIR", default="tessera-jobs", help="folder inside the bucket (default tessera-jobs)")
    p.add_argument("--COMMAND", required=True, help="shell command run in the code folder on every worker")
    p.add_argument("--CQR_EXTRA_ARGS", default="", help="extra flags for `queued-resources create`")
    p.add_argument("--SCRIPT_DIR", default=".", help="local folder shipped to the workers (default: .)")
    p.add_argument("--PROJECT", default="", help="GCP project (default: gcloud's configured one)")
    p.add_argument("--ZONE", default="", help="zone (default: gcloud's configured one)")
    p.add_argument("--POLL_SECONDS", type=float, default=60.0, help="seconds between status checks (default 60)")
    p.add_argument("--TIMEOUT_MINUTES", type=float, default=0.0, help="give up and clean up after this (0: never)")
    args = p.parse_args(argv)
    left = placeholder_flag(args, ("TPU_TYPE", "VERSION", "RUN_NAME", "BUCKET_NAME", "BUCKET_DIR", "CQR_EXTRA_ARGS",
                                   "SCRIPT_DIR", "PROJECT", "ZONE"))
    if left:  # --BUCKET_DIR=<folder> made a folder named so; the others failed in gcloud once the code was uploaded
        p.error(left)
    for flag, example in (("TPU_TYPE", "v5p-256"), ("VERSION", "v2-alpha-tpuv5"), ("COMMAND", "'bash setup.sh'")):
        if not getattr(args, flag).strip():  # an empty command made fresh slices, ran nothing and reported success
            p.error(f"--{flag} is empty; e.g. --{flag}={example}")
    _check_slice_type(p, args)
    if args.NUM_SLICES < 1:
        p.error(f"--NUM_SLICES={args.NUM_SLICES} must be at least 1")
    problem = command_problem(args.COMMAND)
    if problem:  # every worker's `bash -c` failed on it, once the slices had been made and started
        p.error(f"--COMMAND={args.COMMAND!r} {problem}")
    if args.BUCKET_NAME.startswith("gs://"):
        p.error(f"--BUCKET_NAME={args.BUCKET_NAME}: give the bucket name without gs://")
    if not BUCKET_NAME.fullmatch(args.BUCKET_NAME):
        p.error(f"--BUCKET_NAME={args.BUCKET_NAME!r} is not a GCS bucket name: 3-63 lowercase letters, digits, "
                "'-', '_' or '.', starting and ending with a letter or digit (put folders in --BUCKET_DIR)")
    args.SCRIPT_DIR = os.path.expanduser(args.SCRIPT_DIR)  # --SCRIPT_DIR=~/code reaches us as typed (see the runner)
    if not os.path.isdir(args.SCRIPT_DIR):  # before any gcloud call
        p.error(f"--SCRIPT_DIR={args.SCRIPT_DIR} is not a folder; give the folder to ship to the workers "
                "(default: the current one)")
    args.BUCKET_DIR = args.BUCKET_DIR.strip("/")  # jobs/ or /jobs: one folder, not gs://b//jobs//r1
    try:
        shlex.split(args.CQR_EXTRA_ARGS)
    except ValueError as e:
        p.error(f"--CQR_EXTRA_ARGS={args.CQR_EXTRA_ARGS!r} cannot be split into flags ({e}); check its quotes")
    longest = node_name(args, args.NUM_SLICES - 1)
    if not RESOURCE_NAME.fullmatch(args.RUN_NAME) or len(longest) > 63:
        p.error(f"--RUN_NAME={args.RUN_NAME!r} names the queued resource and its slices (up to {longest!r}), and "
                "Google Cloud takes such names only as lowercase letters, digits and hyphens, starting with a letter, "
                "not ending with a hyphen, at most 63 characters; e.g. --RUN_NAME=r1")
    if not (0 < args.POLL_SECONDS < math.inf and 0 <= args.TIMEOUT_MINUTES < math.inf):
        p.error(f"--POLL_SECONDS={args.POLL_SECONDS:g} must be above 0 and --TIMEOUT_MINUTES={args.TIMEOUT_MINUTES:g} "
                "at least 0 (0: no time limit), both finite")
    return args


def _check_slice_type(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--TPU_TYPE and --VERSION in the form gcloud takes (gcloud refused them only after the code was uploaded)."""
    if not TPU_TYPE.fullmatch(args.TPU_TYPE.strip()):
        p.error(f"--TPU_TYPE={args.TPU_TYPE!r} is not an accelerator type: a TPU generation and a size, lowercase, "
                "e.g. --TPU_TYPE=v5p-256, v5litepod-256, v6e-256 or v4-128 (`gcloud compute tpus accelerator-types "
                "list` lists a zone's)")
    if not RUNTIME_VERSION.fullmatch(args.VERSION.strip()):
        p.error(f"--VERSION={args.VERSION!r} is not a TPU VM runtime version: lowercase letters, digits, '-' and "
                "'.', e.g. --VERSION=v2-alpha-tpuv5 (`gcloud compute tpus versions list` lists a zone's)")
    args.TPU_TYPE, args.VERSION = args.TPU_TYPE.strip(), args.VERSION.strip()


def run_url(args: argparse.Namespace) -> str:
    folder = f"{args.BUCKET_DIR}/" if args.BUCKET_DIR else ""  # --BUCKET_DIR='': the run's folder at the top
    return f"gs://{args.BUCKET_NAME}/{folder}{args.RUN_NAME}"


def node_names(args: argparse.Namespace) -> list[str]:
    return [node_name(args, i) for i in range(args.NUM_SLICES)]


def node_name(args: argparse.Namespace, index: int) -> str:
    """Slice `index`'s name: the run's name for one slice, <run>-<index> for several."""
    return args.RUN_NAME if args.NUM_SLICES == 1 else f"{args.RUN_NAME}-{index}"


def create_command(args: argparse.Namespace, script: Path) -> list[str]:
    nodes = ([f"--node-id={args.RUN_NAME}"] if args.NUM_SLICES == 1
             else [f"--node-count={args.NUM_SLICES}", f"--node-prefix={args.RUN_NAME}"])
    return ["alpha", "compute", "tpus", "queued-resources", "create", args.RUN_NAME, *nodes,
            f"--accelerator-type={args.TPU_TYPE}", f"--runtime-version={args.VERSION}",
            f"--metadata-from-file=startup-script={script}", *scope_flags(args.PROJECT, args.ZONE),
            *shlex.split(args.CQR_EXTRA_ARGS)]


class Stopped(Exception):
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) arrived; raised from the signal handler."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


def check_run_folder(args: argparse.Namespace) -> None:
    """Refuse a run folder with status/ or logs/ from an earlier run: its old exit codes would be counted."""
    try:
        listing = gcloud(["storage", "ls", f"{run_url(args)}/"]).splitlines()
    except GcloudError as e:
        if "matched no objects" in str(e):
            return
        raise
    old = sorted({url.rstrip("/").rsplit("/", 1)[-1] for url in listing} & {"status", "logs"})
    if old:
        folders = " and ".join(f"{name}/" for name in old)
        raise GcloudError(f"{run_url(args)}/ already holds {folders} of an earlier run named {args.RUN_NAME} "
                          "(nothing was uploaded); choose another --RUN_NAME or remove it with "
                          f"`gcloud storage rm -r {shlex.quote(run_url(args) + '/')}`")


def upload(args: argparse.Namespace, tmp: Path) -> Path:
    """Upload the code; returns the start-up script written into `tmp`."""
    archive = pack_code(Path(args.SCRIPT_DIR), tmp / "code.tar.gz")
    gcloud(["storage", "cp", str(archive), f"{run_url(args)}/code.tar.gz"])
    script = tmp / "startup.sh"
    script.write_text(STARTUP_SCRIPT.format(run=args.RUN_NAME, run_url=shlex.quote(run_url(args)),
                                            command=shlex.quote(args.COMMAND)))
    return script


def queued_resource_state(args: argparse.Namespace) -> str:
    return gcloud(["alpha", "compute", "tpus", "queued-resources", "describe", args.RUN_NAME,
                   "--format=value(state.state)", *scope_flags(args.PROJECT, args.ZONE)]).strip()


def wait_active(args: argparse.Namespace, deadline: float) -> None:
    last = ""
    while True:
        state = queued_resource_state(args)
        if state != last:
            out(f"queued resource {args.RUN_NAME}: {state}")
            last = state
        if state == "ACTIVE":
            return
        if state in FAILED_STATES:
            raise GcloudError(f"queued resource {args.RUN_NAME} is {state}; see "
                              f"`gcloud alpha compute tpus queued-resources describe {args.RUN_NAME}`")
        _sleep_or_timeout(args, deadline)


def wait_for_workers(args: argparse.Namespace, expected: int, deadline: float) -> dict[str, int]:
    """Exit code of every worker, read from the bucket once all `expected` have reported."""
    status_url = f"{run_url(args)}/status/"
    reported = 0
    while True:
        try:
            listing = [url for url in gcloud(["storage", "ls", status_url]).splitlines() if url.strip()]
        except GcloudError:  # nothing uploaded yet
            listing = []
        if len(listing) != reported:
            reported = len(listing)
            out(f"{reported} of {expected} worker(s) finished")
        if reported >= expected:
            return {url.rsplit("/", 1)[-1]: int(gcloud(["storage", "cat", url]).strip() or 1) for url in listing}
        state = queued_resource_state(args)
        if state in LOST_STATES:
            raise GcloudError(f"queued resource {args.RUN_NAME} is {state} after it was ACTIVE (preempted or "
                              f"failed) with {reported} of {expected} worker(s) reported; logs in "
                              f"{run_url(args)}/logs/")
        _sleep_or_timeout(args, deadline)


def _sleep_or_timeout(args: argparse.Namespace, deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"--TIMEOUT_MINUTES={args.TIMEOUT_MINUTES:g} passed before the job finished")
    time.sleep(args.POLL_SECONDS)


def clean_up(args: argparse.Namespace) -> None:
    for signum in STOP_SIGNALS:  # a second Ctrl-C must not stop the delete
        signal.signal(signum, signal.SIG_IGN)
    out(f"deleting queued resource {args.RUN_NAME}")
    try:
        gcloud(["alpha", "compute", "tpus", "queued-resources", "delete", args.RUN_NAME, "--force", "--quiet",
                "--async", *scope_flags(args.PROJECT, args.ZONE)])
    except GcloudError as e:
        print(f"multihost_job: clean-up failed, delete it by hand: {e}", file=sys.stderr)


def main(argv: list[str]) -> int:
    if sys.version_info < MIN_PYTHON:  # 3.7 ended in an AttributeError (shlex.join) at the first failed gcloud call
        print(f"multihost_job: needs Python {'.'.join(map(str, MIN_PYTHON))} or newer, this is "
              f"{sys.version.split()[0]}; run it with python3.8 or a newer python3 (any, without Tessera's packages)",
              file=sys.stderr)
        return 1
    args = parse_args(argv)
    if shutil.which("gcloud") is None:
        print("multihost_job: no `gcloud` on PATH; install the Google Cloud CLI "
              "(https://cloud.google.com/sdk/docs/install) or add it to PATH", file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.TIMEOUT_MINUTES * 60 if args.TIMEOUT_MINUTES else float("inf")
    for signum in STOP_SIGNALS:  # one ignored by `nohup` (SIGHUP) or `&` in a script (SIGINT) stays ignored: the
        if signal.getsignal(signum) is not signal.SIG_IGN:  # logout deleted the queued resource of a job under nohup
            signal.signal(signum, _raise_stopped)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            check_run_folder(args)  # before the upload: an earlier run's code.tar.gz stays as it was
            script = upload(args, Path(tmp))
        except (GcloudError, Stopped) as e:
            print(f"multihost_job: {e}; nothing was created", file=sys.stderr)
            return getattr(e, "exit_code", 1)
        try:  # from here on the queued resource may exist: every way out deletes it
            try:
                gcloud(create_command(args, script))
            except GcloudError as e:
                print(f"multihost_job: {e}", file=sys.stderr)
                return 1
            out(f"queued resource {args.RUN_NAME} created: {args.NUM_SLICES} x {args.TPU_TYPE}; "
                f"logs will be in {run_url(args)}/logs/")
            wait_active(args, deadline)
            scope = scope_flags(args.PROJECT, args.ZONE)
            expected = sum(describe_slice(name, scope).num_workers for name in node_names(args))
            codes = wait_for_workers(args, expected, deadline)
        except (GcloudError, TimeoutError, Stopped) as e:
            print(f"multihost_job: {e}", file=sys.stderr)
            clean_up(args)
            return getattr(e, "exit_code", 1)
        clean_up(args)
    return report(args, codes)


def report(args: argparse.Namespace, codes: dict[str, int]) -> int:
    failed = {host: code for host, code in sorted(codes.items()) if code}
    for host, code in failed.items():
        print(f"multihost_job: worker {host} {exit_description(code)}; log {run_url(args)}/logs/{host}.log",
              file=sys.stderr)
    out(f"multihost_job: {len(codes) - len(failed)} of {len(codes)} worker(s) succeeded; logs in {run_url(args)}/logs/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
