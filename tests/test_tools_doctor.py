"""tessera.doctor's advice and verdict: the command it prints must reinstall the flavour that was
checked, and a lock it cannot compare against is a problem, never a healthy verdict."""

import jax
import pytest

from tessera import doctor


@pytest.fixture
def no_device_probe(monkeypatch):
    """The devices are not what these tests look at: skip the JAX child process."""
    monkeypatch.setattr(doctor, "device_report", lambda device: (["  1 x cpu (cpu)"], []))


def test_drift_on_a_gpu_install_says_to_reinstall_the_gpu_flavour(tmp_path, capsys, no_device_probe):
    """It said `bash setup.sh`, which installs locks/cpu.txt (the CPU build of JAX) into the GPU venv."""
    lock = tmp_path / "gpu.txt"
    lock.write_text("jax==0.0.1\n")
    assert doctor.main(["--device", "gpu", "--lock", str(lock), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"jax {jax.__version__} (lock 0.0.1); run `bash setup.sh DEVICE=gpu` to install the locked versions" in out
    assert "no CUDA plugin is present; run `bash setup.sh DEVICE=gpu`" in out
    assert "run `bash setup.sh` " not in out
    assert doctor.setup_command("cpu") == "bash setup.sh"
    assert doctor.setup_command("tpu", "latest") == "bash setup.sh DEVICE=tpu MODE=latest"


def test_an_environment_made_elsewhere_is_named_in_the_fix(tmp_path, monkeypatch, capsys, no_device_probe):
    """For an environment made with `bash setup.sh VENV=dir`, the fix said `bash setup.sh DEVICE=gpu`, which made
    a second environment in .venv and left this one as it was."""
    venv = tmp_path / "my envs" / "t"
    venv.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert doctor.setup_command("gpu", prefix=str(venv)) == f"bash setup.sh DEVICE=gpu VENV='{venv}'"
    assert doctor.setup_command("cpu", "latest", prefix=str(tmp_path)) == "bash setup.sh MODE=latest"  # no venv
    monkeypatch.setattr(doctor.sys, "prefix", str(venv))
    lock = tmp_path / "gpu.txt"
    lock.write_text("jax==0.0.1\n")
    assert doctor.main(["--device", "gpu", "--lock", str(lock), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"run `bash setup.sh DEVICE=gpu VENV='{venv}'` to install the locked versions" in out
    # the summary named .venv/bin/python, which is not this environment's interpreter
    monkeypatch.setattr(doctor.sys, "executable", str(venv / "bin" / "python"))
    assert doctor.main(["--device", "gpu", "--lock", str(lock), "--quiet"]) == 1
    assert f"problem(s) found (details: '{venv}/bin/python' -m tessera.doctor)" in capsys.readouterr().out


@pytest.mark.parametrize("text, problem", [
    ("not a lock\n", "has no package==version line for this interpreter"),
    ('jax==0.4 ; python_version >= "3" and\n', "line 1 has an environment marker that does not parse"),
])
def test_a_lock_it_cannot_compare_with_is_a_problem(tmp_path, capsys, no_device_probe, text, problem):
    """A file without pins was 'healthy ... versions as locked in locks/cpu.txt' (another file, and nothing
    compared); a marker that does not parse was a traceback."""
    lock = tmp_path / "lock.txt"
    lock.write_text(text)
    assert doctor.main(["--lock", str(lock), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"doctor: problem: lock file {lock} " in out and problem in out and "healthy" not in out
    assert doctor.main(["--lock", str(tmp_path), "--quiet"]) == 1
    assert f"lock file {tmp_path} is a folder, not a lock file" in capsys.readouterr().out
    assert doctor.main(["--lock", "/dev/null", "--quiet"]) == 1  # it said "/dev/null does not exist"
    assert "lock file /dev/null is not a regular file (a device or a pipe)" in capsys.readouterr().out


def test_the_verdict_names_the_lock_it_compared_with(tmp_path, capsys, no_device_probe):
    lock = tmp_path / "mine.txt"
    lock.write_text(f"jax=={jax.__version__}\n")
    assert doctor.main(["--lock", str(lock), "--quiet"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"versions as locked in {lock})")


def test_a_platform_jax_cannot_start_is_named_with_what_to_do(monkeypatch):
    """JAX_PLATFORMS=cuda without the CUDA plugin: the probe's last line is a bare `AssertionError`, which
    was all the doctor said."""
    import importlib.util

    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        pytest.skip("a CUDA plugin is installed here")
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    rows, problems = doctor.device_report("gpu")
    assert rows == [] and len(problems) == 1
    assert problems[0].startswith("JAX could not start JAX_PLATFORMS=cuda (") and "bash setup.sh DEVICE=gpu" in \
        problems[0], problems


def test_checking_another_flavour_does_not_say_it_was_installed(tmp_path, capsys, monkeypatch):
    """On a CPU install, `--device gpu` printed `installed for DEVICE=gpu` and `DEVICE=gpu was installed but ...`:
    --device only chooses what to check against."""
    monkeypatch.setattr(doctor, "setup_record", lambda: {"DEVICE": "cpu", "MODE": "locked"})
    lock = tmp_path / "gpu.txt"
    lock.write_text(f"jax=={jax.__version__}\n")
    assert doctor.main(["--device", "gpu", "--lock", str(lock)]) == 1
    out = capsys.readouterr().out
    assert "installed for DEVICE=cpu MODE=locked; checked as DEVICE=gpu (--device)" in out
    assert "was installed" not in out and "installed for DEVICE=gpu" not in out
    assert "for DEVICE=gpu, JAX sees no GPU" in out  # conftest's JAX_PLATFORMS=cpu: the probe sees the CPU
