"""setup.sh refuses clearly when it cannot find a usable Python (and changes nothing)."""

import os
import shutil
import subprocess

from conftest import REPO


def _run_setup(tmp_path, env_extra, path):
    env = {"PATH": path, "HOME": str(tmp_path), **env_extra}
    return subprocess.run(["bash", str(REPO / "setup.sh"), f"VENV={tmp_path / 'venv'}"], env=env,
                          capture_output=True, text=True, timeout=60)


def test_no_python_found(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "sort", "head", "rm", "printf"):
        found = shutil.which(tool)
        if found:
            os.symlink(found, bin_dir / tool)
    proc = _run_setup(tmp_path, {}, str(bin_dir))
    assert proc.returncode == 1
    assert "no Python 3.11, 3.12 or 3.13" in proc.stderr and "PYTHON=" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_unusable_python_given(tmp_path):
    proc = _run_setup(tmp_path, {"PYTHON": "/bin/false"}, os.environ["PATH"])
    assert proc.returncode == 1 and "not a usable Python >= 3.11" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_bad_device_argument(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "setup.sh"), "DEVICE=fpga"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "DEVICE=fpga is not one of cpu, gpu, tpu" in proc.stderr


def test_short_disk_stops_before_creating_the_environment(tmp_path):
    # a df that reports 100 MB free on every disk
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "df").write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                                "echo '/dev/x 1000000 900000 102400 90% /'\n")
    (bin_dir / "df").chmod(0o755)
    proc = _run_setup(tmp_path, {}, f"{bin_dir}:{os.environ['PATH']}")
    assert proc.returncode == 1, proc.stderr
    assert "only 100 MB free" in proc.stderr and "needs about 3 GB" in proc.stderr and "VENV=" in proc.stderr
    assert not (tmp_path / "venv").exists()
