"""Is this installation healthy? `.venv/bin/python -m tessera.doctor [--device cpu|gpu|tpu] [--lock FILE] [--quiet]`.

Prints the Python and library versions next to the locked ones (locks/<device>.txt, written by
`bash setup.sh lock`), the devices JAX sees, and known-bad combinations: jax vs jaxlib, jaxlib vs
the CUDA plugin, libtpu vs the version this jax was built against, no accelerator although
DEVICE=gpu|tpu was installed. Ends with a one-line verdict.

Exit codes: 0 healthy; 1 something is wrong (each problem says what to run to fix it); 2 bad
arguments. `setup.sh` runs it last (with --quiet: only warnings and the verdict).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The packages a user asks about first; every other locked package is checked too.
SHOWN = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "flax", "optax", "orbax-checkpoint",
         "grain", "datasets", "tensorboard")
EXIT_HEALTHY, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def read_lock(path: Path) -> dict[str, str]:
    """{package: version} of the lock lines whose environment marker holds for this interpreter; ValueError
    for a line whose marker does not parse."""
    from packaging.markers import InvalidMarker, Marker

    pins = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==([^\s;]+)\s*(?:;\s*(.+))?$", line)
        if not m:
            continue
        name, version, marker = m.groups()
        try:
            applies = marker is None or Marker(marker).evaluate()
        except InvalidMarker:
            raise ValueError(f"line {number} has an environment marker that does not parse: {marker!r}") from None
        if applies:
            pins[_canonical(name.split("[")[0])] = version
    return pins


def setup_command(device: str, mode: str = "locked", prefix: str | None = None) -> str:
    """The setup.sh command that reinstalls this flavour (a bare `bash setup.sh` installs the CPU one) into this
    environment (`prefix`, default sys.prefix): one made elsewhere (setup.sh VENV=dir) is named, or the command
    made a second one in .venv."""
    prefix = sys.prefix if prefix is None else prefix
    elsewhere = (Path(prefix) / "pyvenv.cfg").is_file() and Path(prefix).resolve() != (REPO / ".venv").resolve()
    return " ".join(["bash setup.sh", *([f"DEVICE={device}"] if device != "cpu" else []),
                     *(["MODE=latest"] if mode == "latest" else []),
                     *([f"VENV={shlex.quote(str(Path(prefix).resolve()))}"] if elsewhere else [])])


def setup_record(prefix: str = sys.prefix) -> dict[str, str]:
    """DEVICE and MODE that setup.sh wrote into the venv (empty outside a setup.sh venv)."""
    path = Path(prefix) / "tessera-setup.txt"
    if not path.is_file():
        return {}
    return dict(line.split("=", 1) for line in path.read_text().split() if "=" in line)


def version_problems(lock: dict[str, str], lock_name: str, mode: str, device: str = "cpu"
                     ) -> tuple[list[str], list[str]]:
    """Rows for the version table and the problems found in them."""
    rows, problems, drift = [], [], []
    for name in sorted(set(lock) | {_canonical(n) for n in SHOWN}):
        have, want = installed_version(name), lock.get(name)
        if name in {_canonical(n) for n in SHOWN} and (have or want):
            mark = "locked" if have == want else ("not locked" if want is None else f"lock: {want or 'absent'}")
            rows.append(f"  {name:<24} {have or 'not installed':<16} {mark}")
        if want and have != want:
            drift.append(f"{name} {have or 'not installed'} (lock {want})")
    if drift and mode != "latest":
        problems.append(f"{len(drift)} package(s) differ from {lock_name}: {', '.join(drift[:6])}"
                        f"{' ...' if len(drift) > 6 else ''}; run `{setup_command(device)}` to install the locked "
                        "versions")
    return rows, problems


def combination_problems(device: str, mode: str = "locked") -> list[str]:
    """Known-bad combinations of jax, jaxlib, the CUDA plugin and libtpu."""
    problems, fix = [], setup_command(device, mode)
    jax_v, jaxlib_v = installed_version("jax"), installed_version("jaxlib")
    if jax_v is None or jaxlib_v is None:
        return [f"jax ({jax_v or 'missing'}) or jaxlib ({jaxlib_v or 'missing'}) is not installed; run `{fix}`"]
    if jax_v != jaxlib_v:
        problems.append(f"jax {jax_v} with jaxlib {jaxlib_v}: they are released together; run `{fix}`")
    for plugin in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt"):
        v = installed_version(plugin)
        if v and v != jaxlib_v:
            problems.append(f"{plugin} {v} does not match jaxlib {jaxlib_v}: JAX will not load the GPU backend; "
                            f"run `{setup_command('gpu', mode)}`")
    wanted_libtpu = _libtpu_built_against()
    libtpu_v = installed_version("libtpu")
    if libtpu_v and wanted_libtpu and not wanted_libtpu.contains(libtpu_v, prereleases=True):
        problems.append(f"libtpu {libtpu_v} does not satisfy libtpu{wanted_libtpu}, the requirement of jax {jax_v} "
                        f"(an older libtpu may not load); run `{setup_command('tpu', mode)}`")
    if device == "gpu" and not installed_version("jax-cuda12-plugin"):
        problems.append(f"for DEVICE=gpu, no CUDA plugin is present; run `{fix}`")
    return problems


def _libtpu_built_against():
    """The libtpu requirement of jax's `tpu` extra (a SpecifierSet such as ==0.0.50.*), or None."""
    from packaging.requirements import Requirement

    try:
        requires = metadata.requires("jax") or []
    except metadata.PackageNotFoundError:
        return None
    for text in requires:
        req = Requirement(text)
        if _canonical(req.name) == "libtpu" and req.marker and req.marker.evaluate({"extra": "tpu"}):
            return req.specifier
    return None


def device_report(device: str, timeout: float = 120.0) -> tuple[list[str], list[str]]:
    """Ask JAX (in a child process, so a hanging backend cannot hang the doctor) what it sees."""
    probe = ("import jax, collections; ds = jax.devices(); "
             "c = collections.Counter((d.platform, d.device_kind) for d in ds); "
             "print(';'.join(f'{p}|{k}|{n}' for (p, k), n in c.items()))")
    env = dict(os.environ)
    if device == "cpu":
        env.setdefault("JAX_PLATFORMS", "cpu")  # libtpu's probe for TPU chips is slow and noisy on a CPU host
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [], [f"JAX did not list its devices within {timeout:.0f} s (a backend is hanging); "
                    "try JAX_PLATFORMS=cpu to check the rest, then the accelerator's driver"]
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        if env.get("JAX_PLATFORMS"):  # JAX_PLATFORMS=cuda without the CUDA plugin: a bare AssertionError
            return [], [f"JAX could not start JAX_PLATFORMS={env['JAX_PLATFORMS']} ({last}); unset JAX_PLATFORMS to "
                        f"see what this host has, or run `{setup_command('gpu')}` for NVIDIA GPUs"]
        return [], [f"JAX could not list its devices: {last}"]
    rows, platforms = [], set()
    for item in filter(None, out.stdout.strip().split(";")):
        platform, kind, count = item.split("|")
        platforms.add(platform)
        rows.append(f"  {count} x {kind} ({platform})")
    problems = []
    if device == "gpu" and "gpu" not in platforms and "cuda" not in platforms:
        problems.append("for DEVICE=gpu, JAX sees no GPU; check `nvidia-smi` and the driver, "
                        "or re-run `bash setup.sh DEVICE=gpu`")
    if device == "tpu" and "tpu" not in platforms:
        problems.append("for DEVICE=tpu, JAX sees no TPU; run on a TPU VM (or use DEVICE=cpu here)")
    return rows, problems


def doctor_command() -> str:
    """How to run the doctor with this interpreter: `.venv/bin/python -m tessera.doctor` for the
    repository's own venv, else this venv's python by its path (setup.sh VENV=dir)."""
    ours = Path(sys.prefix).resolve() == (REPO / ".venv").resolve()
    return f"{'.venv/bin/python' if ours else shlex.quote(sys.executable)} -m tessera.doctor"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=doctor_command(),
        description="Check this installation: versions against the lock, devices, known-bad combinations. "
                    "Exit 0 healthy, 1 problems found (each with the command that fixes it).",
        epilog="The install and the locks are described in README.md (Install); setup.sh runs this last.")
    parser.add_argument("--device", choices=("cpu", "gpu", "tpu"),
                        help="the flavour to check against (default: what setup.sh installed, else cpu)")
    parser.add_argument("--lock", type=Path, help="lock file to compare with (default: locks/<device>.txt)")
    parser.add_argument("--quiet", action="store_true", help="print only problems and the verdict")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    record = setup_record()
    device = args.device or record.get("DEVICE", "cpu")
    mode = record.get("MODE", "locked")
    lock_path = (args.lock or REPO / "locks" / f"{device}.txt").resolve()
    say = (lambda *a, **k: None) if args.quiet else print
    installed = record.get("DEVICE", "cpu")  # --device checks against another flavour; it installs nothing
    say(f"Python {sys.version.split()[0]} at {sys.executable}; installed for DEVICE={installed} MODE={mode}"
        f"{'' if record else ' (no setup.sh record in this venv: assuming cpu, locked)'}"
        f"{f'; checked as DEVICE={device} (--device)' if device != installed else ''}")
    problems: list[str] = []
    lock_name = str(lock_path.relative_to(REPO)) if lock_path.is_relative_to(REPO) else str(lock_path)
    try:
        lock = read_lock(lock_path) if lock_path.is_file() else None
    except (ValueError, OSError, UnicodeDecodeError) as e:
        lock, problems = None, [f"lock file {lock_name} cannot be read ({e}); pass a lock written by "
                                "`bash setup.sh lock` (locks/<device>.txt)"]
    if lock:
        rows, found = version_problems(lock, lock_name, mode, device)
        say("packages (installed, vs the lock):", *rows, sep="\n")
        problems += found
    elif lock is not None:  # a file, but not a lock: nothing would be compared, and the verdict said healthy
        problems.append(f"lock file {lock_name} has no package==version line for this interpreter; pass a lock "
                        "written by `bash setup.sh lock` (locks/<device>.txt)")
    elif not problems:
        state = ("is a folder, not a lock file" if lock_path.is_dir() else
                 "is not a regular file (a device or a pipe)" if lock_path.exists() else "does not exist")
        problems.append(f"lock file {lock_path} {state}; run `bash setup.sh lock` or pass --lock FILE")
    problems += combination_problems(device, mode)
    rows, found = device_report(device)
    say("devices JAX sees:", *(rows or ["  none"]), sep="\n")
    problems += found
    for p in problems:
        print(f"doctor: problem: {p}")
    jax_v = installed_version("jax")
    if problems:
        print(f"doctor: {len(problems)} problem(s) found (details: {doctor_command()})")
        return EXIT_PROBLEMS
    print(f"doctor: healthy (jax {jax_v}, {'; '.join(r.strip() for r in rows)}, versions as locked in "
          f"{lock_name})" if mode == "locked" else f"doctor: healthy (jax {jax_v}, MODE=latest)")
    return EXIT_HEALTHY


if __name__ == "__main__":
    sys.exit(main())
