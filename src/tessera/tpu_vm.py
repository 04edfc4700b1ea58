"""gcloud commands for Cloud TPU VMs, shared by `multihost_runner.py` and `multihost_job.py`.

Standard library only, and Python 3.8's (MIN_PYTHON): the launchers run on a workstation that may
not have Tessera's dependencies installed, with its own python3. Every call goes through the
`gcloud` found on PATH (the tests put a fake one first), and a failed call raises `GcloudError`
with the command and its output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

# Never shipped to the workers: version control, local environments (.venv-hf: the reference
# environment of `setup.sh HF_REFERENCE=1`, over a gigabyte) and run outputs.
EXCLUDED_FROM_CODE = {".git", ".venv", ".venv-hf", "outputs", "__pycache__", ".pytest_cache", "logs"}
# A value the docs leave to fill in: gs://<bucket>/runs, <changeme>. Unquoted, bash reads `<bucket` and `>/runs`
# as redirections, so `bash -n` passed it and every worker then failed with "bucket: No such file or directory".
PLACEHOLDER = re.compile(r"<[A-Za-z][-\w.]*>")


MIN_PYTHON = (3, 8)  # of the launchers, run by a workstation's python3: this file and theirs are tested with it


class GcloudError(RuntimeError):
    """A gcloud command failed; the message holds the command and what it printed."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """One TPU slice (a TPU VM node), the internal and external IPs of its workers and its state."""

    name: str
    internal_ips: tuple[str, ...]
    external_ips: tuple[str, ...]
    state: str = ""  # READY once its workers run; CREATING, STOPPED, PREEMPTED, ... ("" when not listed)

    @property
    def num_workers(self) -> int:
        return len(self.internal_ips)


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ValueError(f"{text!r} is not true or false")


# what ended a command that exited with 128 + a signal's number, where it is not plain
SIGNAL_HINTS = {"SIGKILL": "the kernel's out-of-memory killer, or kill -9",
                "SIGABRT": "JAX's runtime after a peer process died (getting_started/Multi_process.md)",
                "SIGTERM": "Tessera saves and exits so after a SIGTERM"}


def exit_description(code: int) -> str:
    """`exited with code N`, naming the signal when N is 128 + its number (137 is SIGKILL's)."""
    text = f"exited with code {code}"
    try:
        name = signal.Signals(code - 128).name if 128 < code < 192 else ""
    except ValueError:
        name = ""
    if name:
        hint = SIGNAL_HINTS.get(name)
        text += f" (128 + {code - 128}: stopped by {name}{'; ' + hint if hint else ''})"
    return text


def command_problem(command: str) -> str:
    """Why `command` would fail on every worker before doing anything ("" when it looks runnable): bash cannot
    parse it (`bash -n`, skipped on a host without bash), or it still holds a <placeholder>."""
    if shutil.which("bash") is not None:
        proc = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        if proc.returncode:
            first = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[0]  # the next echoes it
            first = first[len("bash: -c: "):] if first.startswith("bash: -c: ") else first  # no removeprefix in 3.8
            return (f"is not a bash command ({first}): every worker would fail to start "
                    "it; check its quotes and fill in any <placeholder>")
    left = PLACEHOLDER.findall(_outside_single_quotes(command))
    if left:
        return (f"still holds {', '.join(dict.fromkeys(left))}, a placeholder to fill in (unquoted, bash reads <name> "
                "as a redirection and every worker fails on it); put in the real value (a redirection: spaces "
                "around < and >; literal text: single quotes)")
    return ""


def placeholder_flag(args, names: tuple[str, ...]) -> str:
    """The first of the flags `names` of `args` whose value still holds a <placeholder>, as an error line ("" if
    none)."""
    for name in names:
        value = getattr(args, name)
        found = PLACEHOLDER.search(value) if isinstance(value, str) else None
        if found:
            return f"--{name}={value!r} still holds {found.group()}, a placeholder to fill in; put in the real value"
    return ""


def _outside_single_quotes(command: str) -> str:
    """`command` with what bash takes literally blanked out: single-quoted text and backslash-escaped characters."""
    kept, quote, i = [], "", 0
    while i < len(command):
        c = command[i]
        if quote == "'" or (c == "'" and not quote):
            quote = "" if quote == "'" and c == "'" else "'"
            kept.append(" ")
        elif c == "\\":
            kept.append("  ")
            i += 1
        else:
            quote = ('"' if not quote else "") if c == '"' else quote
            kept.append(c)
        i += 1
    return "".join(kept)


def scope_flags(project: str, zone: str) -> list[str]:
    """--project/--zone when given (gcloud's configured defaults apply otherwise)."""
    return ([f"--project={project}"] if project else []) + ([f"--zone={zone}"] if zone else [])


def gcloud(args: list[str], capture: bool = True) -> str:
    """Run `gcloud <args>`; returns stdout, raises GcloudError with the output on failure."""
    proc = subprocess.run(["gcloud", *args], capture_output=capture, text=True, encoding="utf-8", errors="replace")
    if proc.returncode:
        output = ((proc.stderr or "") + (proc.stdout or "")).strip() if capture else "(output above)"
        raise GcloudError(f"`gcloud {shlex.join(args)}` failed with exit code {proc.returncode}:\n{output}")
    return proc.stdout or ""


def out(text: str, end: str = "\n") -> None:
    """Print to stdout; once its reader is gone (`| head`), the rest goes to /dev/null. The BrokenPipeError
    ended multihost_runner's thread echoing slice 0 worker 0 (which then blocked on its full pipe, and the
    job with it), and multihost_job before it deleted its queued resource (the slices were left running)."""
    try:
        print(text, end=end, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _slice_from_node(node: dict) -> Slice:
    endpoints = node.get("networkEndpoints") or []
    return Slice(
        name=node["name"].rsplit("/", 1)[-1],
        internal_ips=tuple(e.get("ipAddress", "") for e in endpoints),
        external_ips=tuple((e.get("accessConfig") or {}).get("externalIp", "") for e in endpoints),
        state=node.get("state", ""),
    )


def find_slices(prefix: str, scope: list[str]) -> list[Slice]:
    """The slice named `prefix`, or else the slices `prefix-0`, `prefix-1`, ... in index order."""
    nodes = json.loads(gcloud(["compute", "tpus", "tpu-vm", "list", "--format=json", *scope]) or "[]")
    slices = {s.name: s for s in map(_slice_from_node, nodes)}
    if prefix in slices:
        return _ready([slices[prefix]])
    numbered = {}
    for name, s in slices.items():
        match = re.fullmatch(re.escape(prefix) + r"-(\d+)", name)
        if match:
            numbered[int(match.group(1))] = s
    if not numbered:
        raise GcloudError(f"no TPU VM named {prefix!r} or {prefix}-<n> in {' '.join(scope) or 'the default zone'}; "
                          f"found: {', '.join(sorted(slices)) or 'none'}")
    if sorted(numbered) != list(range(len(numbered))):
        raise GcloudError(f"slices {prefix}-<n> are not numbered 0..{len(numbered) - 1}: {sorted(numbered)}")
    return _ready([numbered[i] for i in range(len(numbered))])


def _ready(slices: list[Slice]) -> list[Slice]:
    """The slices, if every one is READY with its workers listed: a slice still CREATING has no workers
    yet, and the runner then ran on none of them and reported success (or failed on an IndexError)."""
    waiting = [s for s in slices if s.state not in ("", "READY") or not s.num_workers]
    if waiting:
        listed = ", ".join(f"{s.name} ({s.state or 'no state'}, {s.num_workers} workers)" for s in waiting)
        raise GcloudError(f"slice(s) not ready: {listed}; wait until `gcloud compute tpus tpu-vm list` shows "
                          "them READY, then run again")
    return slices


def describe_slice(name: str, scope: list[str]) -> Slice:
    node = json.loads(gcloud(["compute", "tpus", "tpu-vm", "describe", name, "--format=json", *scope]))
    return _slice_from_node(node)


def pack_code(script_dir: Path, archive: Path) -> Path:
    """Write `script_dir` (without EXCLUDED_FROM_CODE) as a .tar.gz; returns the archive path."""
    script_dir = script_dir.resolve()
    if not script_dir.is_dir():
        raise GcloudError(f"SCRIPT_DIR {script_dir} is not a directory")

    def keep(info: tarfile.TarInfo):
        return None if set(Path(info.name).parts) & EXCLUDED_FROM_CODE else info

    try:
        with tarfile.open(archive, "w:gz") as tar:
            for child in sorted(script_dir.iterdir()):
                tar.add(child, arcname=child.name, filter=keep)
    except OSError as e:  # a full temporary folder, or a file that cannot be read, was a traceback
        if e.filename and Path(e.filename) != archive:
            raise GcloudError(f"cannot pack {script_dir}: {e.filename}: {e.strerror}; make it readable or move it "
                              "out of the folder") from None
        raise GcloudError(f"cannot pack {script_dir} into {archive}: {e.strerror}; free some space in "
                          f"{archive.parent.parent} or set TMPDIR to a folder with room") from None
    return archive
