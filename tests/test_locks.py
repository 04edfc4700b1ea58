"""The lock files agree with the ranges, setup.sh installs from them, and the doctor judges an install."""

import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from conftest import REPO

# lock file -> the ranges file it is resolved from (bash setup.sh lock)
LOCKS = {"cpu": "requirements.txt", "gpu": "requirements-gpu.txt", "tpu": "requirements-tpu.txt",
         "hf": "requirements-hf.txt"}


def _ranges(name: str) -> list[Requirement]:
    """Requirements of a requirements file, following `-r other.txt` includes."""
    out = []
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            out += _ranges(line[3:].strip())
        elif line:
            out.append(Requirement(line))
    return out


def _pins(flavour: str) -> dict[str, list[str]]:
    """{package: [versions]} of a lock (a package may have one version per Python range)."""
    pins: dict[str, list[str]] = {}
    for line in (REPO / "locks" / f"{flavour}.txt").read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            req = Requirement(line)
            (version,) = [s.version for s in req.specifier]
            pins.setdefault(req.name.lower(), []).append(version)
    return pins


@pytest.mark.parametrize("flavour", sorted(LOCKS))
def test_every_locked_version_satisfies_the_ranges(flavour):
    pins = _pins(flavour)
    checked = 0
    for req in _ranges(LOCKS[flavour]):
        name = req.name.lower()
        if flavour == "hf" and name == "torch":
            assert "torch" not in pins  # installed on its own from requirements-hf.txt (its CPU build)
            continue
        assert name in pins, f"{name} (from {LOCKS[flavour]}) is missing from locks/{flavour}.txt; run bash setup.sh lock"
        for version in pins[name]:
            assert req.specifier.contains(version, prereleases=True), \
                f"locks/{flavour}.txt pins {name}=={version}, outside {req} in {LOCKS[flavour]}; run bash setup.sh lock"
            checked += 1
    assert checked >= 4


def test_locks_are_exact_and_name_their_refresh_command():
    for flavour in LOCKS:
        text = (REPO / "locks" / f"{flavour}.txt").read_text()
        assert "bash setup.sh lock" in text.splitlines()[1]
        pins = _pins(flavour)
        assert "numpy" in pins and all(v[0].isdigit() for vs in pins.values() for v in vs)
    assert not any(n.startswith("nvidia-") for n in _pins("hf")), "the CPU reference env must not pull CUDA wheels"
    assert "jax-cuda12-plugin" in _pins("gpu") and "libtpu" in _pins("tpu")


def _doctor(*args):
    return subprocess.run([sys.executable, "-m", "tessera.doctor", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_doctor_reports_healthy_install():
    """CI installs from the lock through setup.sh, so this venv must match it."""
    proc = _doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "jax " in out and "orbax-checkpoint" in out and "devices JAX sees:" in out and "x cpu" in out
    assert out.strip().splitlines()[-1].startswith("doctor: healthy")


def test_doctor_names_a_version_that_differs_from_the_lock(tmp_path):
    import jax

    lock = tmp_path / "lock.txt"
    lock.write_text("jax==0.0.1\nnumpy==0.0.2 ; python_version < '3'\n")  # the second never applies
    proc = _doctor("--lock", str(lock), "--quiet")
    assert proc.returncode == 1
    assert f"jax {jax.__version__} (lock 0.0.1)" in proc.stdout and "run `bash setup.sh`" in proc.stdout
    assert "numpy" not in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("doctor: 1 problem(s) found")


def test_doctor_refuses_a_missing_lock_and_bad_arguments(tmp_path):
    proc = _doctor("--lock", str(tmp_path / "nope.txt"), "--quiet")
    assert proc.returncode == 1 and "does not exist" in proc.stdout
    assert _doctor("--device", "fpga").returncode == 2


def test_setup_refuses_unknown_mode_and_prints_help():
    bad = subprocess.run(["bash", str(REPO / "setup.sh"), "MODE=nightly"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "MODE=nightly is not one of locked, latest" in bad.stderr
    helped = subprocess.run(["bash", str(REPO / "setup.sh"), "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "MODE=locked|latest" in helped.stdout and "bash setup.sh lock" in helped.stdout
