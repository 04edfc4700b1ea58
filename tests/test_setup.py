"""setup.sh refuses clearly when it cannot find a usable Python (and changes nothing)."""

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

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


# ---- A stand-in Python: enough of an interpreter for setup.sh to run end to end in a second, without
# installing anything. `-m venv DIR` makes a stub environment (with pip unless told otherwise), `-m pip`
# logs its arguments to <venv>/pip.log (and fails like Python does when the environment has no pip), then
# runs <venv>/stub-pip.sh if there is one (an environment it makes gets its own folder's); the doctor exits
# with $STUB_DOCTOR_RC.
STUB = r'''#!BASH
here=$(cd "$(dirname "$0")" && pwd)
version=$(cat "$here/stub-version")
case "$1" in
  --version) echo "Python $version.0"; exit 0 ;;
  -c) case "$2" in
        *ensurepip*) echo "$version"; exit 0 ;;
        "import pip") [ -f "$here/../stub-pip" ]; exit ;;
        *torch*) echo "torch stub, transformers stub"; exit 0 ;;
        *jax*) echo 0.0.stub; exit 0 ;;
      esac ;;
  -m) case "$2" in
        venv) mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; cp "$here/stub-version" "$3/bin/"
              echo "home = $here" > "$3/pyvenv.cfg"
              touch "$3/stub-pip"; [ ! -f "$here/stub-pip.sh" ] || cp "$here/stub-pip.sh" "$3/"; exit 0 ;;
        pip) [ -f "$here/../stub-pip" ] || { echo "$0: No module named pip" >&2; exit 1; }
             echo "${*:3}" >> "$here/../pip.log"
             [ -f "$here/../stub-pip.sh" ] && . "$here/../stub-pip.sh"; exit 0 ;;
        tessera.doctor) echo "doctor: stub verdict"; exit "${STUB_DOCTOR_RC:-0}" ;;
      esac ;;
esac
echo "stub python: unexpected arguments: $*" >&2
exit 9
'''
TOOLS = ("bash", "dirname", "basename", "sort", "head", "rm", "ls", "mkdir", "cp", "cat", "sed", "awk", "df",
         "touch", "grep", "tr", "uname")


def stub_python(bin_dir: Path, version: str, name: str = "python") -> Path:
    """A stub interpreter `bin_dir/name` that reports Python `version` ("3.12")."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "stub-version").write_text(version + "\n")
    path = bin_dir / name
    path.write_text(STUB.replace("BASH", shutil.which("bash")))
    path.chmod(0o755)
    return path


def stub_venv(venv: Path, version: str, pip: bool = True) -> None:
    """An existing environment as setup.sh would find it: pyvenv.cfg, bin/python, pip or not."""
    stub_python(venv / "bin", version)
    (venv / "pyvenv.cfg").write_text("home = /nowhere\n")
    if pip:
        (venv / "stub-pip").touch()


def tools_dir(tmp_path: Path) -> Path:
    """A PATH folder with the tools setup.sh uses and no Python."""
    bin_dir = tmp_path / "tools"
    bin_dir.mkdir()
    for tool in TOOLS:
        os.symlink(shutil.which(tool), bin_dir / tool)
    return bin_dir


def run_setup(*args, cwd=None, env=None, setup_sh=None) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), **(env or {})}
    return subprocess.run(["bash", str(setup_sh or REPO / "setup.sh"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_python_without_venv_on_path_gets_the_message_not_a_silent_exit(tmp_path):
    # every python on PATH fails the check (say Debian's python3 without python3-venv); no pyenv folder
    tools = tools_dir(tmp_path)
    (tools / "python3").write_text("#!/bin/sh\necho \"No module named 'ensurepip'\" >&2\nexit 1\n")
    (tools / "python3").chmod(0o755)
    proc = run_setup(f"VENV={tmp_path / 'venv'}", env={"PATH": str(tools), "HOME": str(tmp_path)})
    assert proc.returncode == 1
    assert "no Python 3.11, 3.12 or 3.13 with the venv module was found" in proc.stderr
    assert "PYTHON=/path/to/python3.12" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_only_newer_pythons_are_named_with_the_command_that_uses_one_anyway(tmp_path):
    """A machine with only a Python newer than the lock is tested on was told that it had none."""
    tools = tools_dir(tmp_path)
    py314 = stub_python(tools, "3.14", "python3")
    (tools / "python3.14").symlink_to(py314)  # the same version under two names: named once
    py315 = stub_python(tmp_path / ".pyenv" / "versions" / "3.15.0" / "bin", "3.15", "python3")
    stub_python(tmp_path / ".pyenv" / "versions" / "3.10.4" / "bin", "3.10", "python3")  # too old for PYTHON=
    proc = run_setup(f"VENV={tmp_path / 'venv'}", env={"PATH": str(tools), "HOME": str(tmp_path)})
    assert proc.returncode == 1 and not (tmp_path / "venv").exists()
    lines = proc.stderr.splitlines()
    assert lines[0] == "setup.sh: no Python 3.11, 3.12 or 3.13 with the venv module was found."
    assert lines[1:5] == ["  Newer than Tessera is tested with (its lock is tested on 3.11 to 3.13), found:",
                          f"    {tools / 'python3'} (Python 3.14)", f"    {py315} (Python 3.15)",
                          f"  To try one anyway: bash setup.sh PYTHON={tools / 'python3'}"]
    assert "3.10" not in proc.stderr and "PYTHON=/path/to/python3.12" in lines[-1]


def test_pyenv_pythons_are_found_without_pyenv_on_path(tmp_path):
    tools = tools_dir(tmp_path)
    stub_python(tools, "3.11", "python3")
    py312 = stub_python(tmp_path / ".pyenv" / "versions" / "3.12.9" / "bin", "3.12", "python3")
    proc = run_setup(f"VENV={tmp_path / 'venv'}", env={"PATH": str(tools), "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert f"creating {tmp_path / 'venv'} with {py312} (Python 3.12)" in proc.stdout
    assert "note: using Python 3.11" not in proc.stdout


def test_help_works_from_another_directory(tmp_path):
    proc = run_setup("--help", cwd=tmp_path, setup_sh=os.path.relpath(REPO / "setup.sh", tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "MODE=locked|latest" in proc.stdout and proc.stderr == ""


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_venv_folder_that_is_not_an_environment_is_never_deleted(tmp_path, kind):
    py = stub_python(tmp_path / "py", "3.12")
    target = tmp_path / "thesis"
    if kind == "folder":
        target.mkdir()
        (target / "chapter1.tex").write_text("precious")
    else:
        target.write_text("precious")
    tools = tools_dir(tmp_path)
    stub_python(tools, "3.11", "python3.11")  # for the reference environment
    env = {"PATH": str(tools), "HOME": str(tmp_path)}
    for args in ([f"VENV={target}"], [f"VENV={tmp_path / 'venv'}", "HF_REFERENCE=1", f"HF_VENV={target}"]):
        proc = run_setup(f"PYTHON={py}", *args, env=env)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"{target} exists and is not a virtual environment" in proc.stderr
        assert (target / "chapter1.tex" if kind == "folder" else target).read_text() == "precious"


def test_an_environment_left_without_pip_by_an_interrupted_setup_is_made_anew(tmp_path):
    venv = tmp_path / "venv"
    stub_venv(venv, "3.12", pip=False)  # Ctrl-C while `python -m venv` ran ensurepip
    py = stub_python(tmp_path / "py", "3.12")
    proc = run_setup(f"PYTHON={py}", f"VENV={venv}")
    assert proc.returncode == 0, proc.stderr
    assert f"{venv} has no pip" in proc.stdout and "making it anew" in proc.stdout
    log = (venv / "pip.log").read_text()
    assert "install -q -r locks/cpu.txt" in log and "install -q --no-deps -e ." in log


def test_an_environment_of_an_old_python_is_refused(tmp_path):
    venv = tmp_path / "venv"
    stub_venv(venv, "3.10")
    proc = run_setup(f"VENV={venv}")
    assert proc.returncode == 1
    assert f"{venv} has Python 3.10, but Tessera needs 3.11 or newer" in proc.stderr and "rm -rf" in proc.stderr
    assert not (venv / "pip.log").exists()


def test_python_override_that_differs_from_the_existing_environment_is_not_ignored(tmp_path):
    venv = tmp_path / "venv"
    stub_venv(venv, "3.12")
    py = stub_python(tmp_path / "py", "3.13")
    proc = run_setup(f"PYTHON={py}", f"VENV={venv}")
    assert proc.returncode == 1
    assert f"{venv} has Python 3.12, not the 3.13 of PYTHON={py}" in proc.stderr
    assert not (venv / "pip.log").exists()
    same = stub_python(tmp_path / "py_same", "3.12")
    assert run_setup(f"PYTHON={same}", f"VENV={venv}").returncode == 0  # the same version: reused


def test_relative_python_path_is_taken_from_where_setup_was_started(tmp_path):
    stub_python(tmp_path / "py", "3.12", "python3")
    proc = run_setup("PYTHON=py/python3", f"VENV={tmp_path / 'venv'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"with {tmp_path}/py/python3 (Python 3.12)" in proc.stdout
    # started elsewhere, so the printed commands say where to run them
    assert f"From {REPO} (the commands of the docs run from there)" in proc.stdout


def test_doctor_problems_fail_a_cpu_install_but_not_one_prepared_for_an_accelerator(tmp_path):
    venv = tmp_path / "venv"
    stub_venv(venv, "3.12")
    proc = run_setup(f"VENV={venv}", env={"STUB_DOCTOR_RC": "1"})
    assert proc.returncode == 1
    assert "the doctor found problems (above)" in proc.stderr and "doctor: stub verdict" in proc.stdout
    proc = run_setup(f"VENV={venv}", "DEVICE=tpu", env={"STUB_DOCTOR_RC": "1"})  # e.g. a login host without TPUs
    assert proc.returncode == 0, proc.stderr
    assert run_setup(f"VENV={venv}").returncode == 0


def test_reference_environment_elsewhere_names_the_variable_that_finds_it(tmp_path):
    tools = tools_dir(tmp_path)
    stub_python(tools, "3.11", "python3.11")
    venv, hf_venv = tmp_path / "venv", tmp_path / "hf"
    stub_venv(venv, "3.12")
    proc = run_setup(f"VENV={venv}", "HF_REFERENCE=1", f"HF_VENV={hf_venv}",
                 env={"PATH": str(tools), "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert f"export TESSERA_HF_PYTHON={hf_venv}/bin/python" in proc.stdout
    assert "torch==" in (hf_venv / "pip.log").read_text()


def _two_stub_environments(tmp_path, main_pip: str, hf_pip: str):
    """A stub main environment and a stub Python 3.11 for the reference one, whose pips run these scripts."""
    tools = tools_dir(tmp_path)
    for tool in ("seq", "sleep"):
        os.symlink(shutil.which(tool), tools / tool)
    stub_python(tools, "3.11", "python3.11")
    venv, hf_venv = tmp_path / "venv", tmp_path / "hf"
    stub_venv(venv, "3.12")
    (venv / "stub-pip.sh").write_text(main_pip)
    (tools / "stub-pip.sh").write_text(hf_pip)  # copied into the reference environment its `-m venv` makes
    return tools, venv, hf_venv


def test_the_reference_environment_installs_alongside_the_main_one(tmp_path):
    """HF_REFERENCE=1 installed the reference environment after the main one (72 s of CI's 174 s of setup).
    Its packages now install while the main environment's do: here the main pip waits for the reference
    pip to have started (setup.sh in sequence failed it), and the reference pip's output comes after."""
    started = tmp_path / "hf-started"
    wait = f'for i in $(seq 100); do [ -f {started} ] && return 0; sleep 0.1; done; echo never >&2; exit 7\n'
    tools, venv, hf_venv = _two_stub_environments(tmp_path, wait, f"echo 'hf pip says hello'; touch {started}\n")
    proc = run_setup(f"VENV={venv}", "HF_REFERENCE=1", f"HF_VENV={hf_venv}",
                     env={"PATH": str(tools), "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.index("setup.sh: installed (DEVICE=cpu") < proc.stdout.index("hf pip says hello") \
        < proc.stdout.index("Hugging Face reference ready")
    assert "hf pip says hello" in (hf_venv / "setup.log").read_text()


def test_a_failed_reference_install_is_reported_and_a_failed_main_one_stops_it(tmp_path):
    """The background install's failure ends setup.sh with its exit code and its output, after the main
    environment is installed; a failure of the main install stops the reference one at once (no pip left
    running on its own)."""
    tools, venv, hf_venv = _two_stub_environments(tmp_path, "", "echo 'ERROR: no torch for you' >&2; exit 3\n")
    proc = run_setup(f"VENV={venv}", "HF_REFERENCE=1", f"HF_VENV={hf_venv}", env={"PATH": str(tools)})
    assert proc.returncode == 3, proc.stderr
    assert "ERROR: no torch for you" in proc.stdout and "setup.sh: installed (DEVICE=cpu" in proc.stdout
    assert (f"installing the reference environment in {hf_venv} failed (exit 3, see above); the main environment "
            f"in {venv} is installed") in proc.stderr

    finished = tmp_path / "hf-finished"
    (tmp_path / "2").mkdir()
    tools_2, venv, hf_venv = _two_stub_environments(tmp_path / "2", "echo 'ERROR: no jax' >&2; exit 4\n",
                                                    f"sleep 3; touch {finished}\n")
    proc = run_setup(f"VENV={venv}", "HF_REFERENCE=1", f"HF_VENV={hf_venv}", env={"PATH": str(tools_2)})
    assert proc.returncode == 4 and "ERROR: no jax" in proc.stderr, proc.stderr
    assert f"stopped the install of the reference environment in {hf_venv} too" in proc.stderr
    time.sleep(4)
    assert not finished.exists()


def test_pip_and_the_build_of_tessera_itself_are_pinned_not_the_newest_on_pypi(tmp_path):
    """`pip install --upgrade pip` took whatever pip PyPI had that day, and the editable install built
    Tessera with the newest setuptools (build isolation): two releases outside the lock that every fresh
    install ran, and the reason a re-run needed the network. Both environments now take the pinned pip,
    and Tessera is built with the locked setuptools (requirements.txt has it)."""
    tools = tools_dir(tmp_path)
    stub_python(tools, "3.11", "python3.11")
    venv, hf_venv = tmp_path / "venv", tmp_path / "hf"
    stub_venv(venv, "3.12")
    proc = run_setup(f"VENV={venv}", "HF_REFERENCE=1", f"HF_VENV={hf_venv}", env={"PATH": str(tools)})
    assert proc.returncode == 0, proc.stderr
    pinned = re.search(r"^PIP_VERSION=(\d+\.\d+(\.\d+)?) ", (REPO / "setup.sh").read_text(), re.M)[1]
    for log in ((venv / "pip.log").read_text(), (hf_venv / "pip.log").read_text()):
        assert f"install -q pip=={pinned}\n" in log and "--upgrade pip" not in log, log
    docker = (REPO / "getting_started" / "Dockerfile").read_text()
    assert f"pip install -q pip=={pinned} " in docker and "--upgrade pip" not in docker
    assert "install -q --no-deps -e . --no-build-isolation\n" in (venv / "pip.log").read_text()
    build = re.search(r'requires = \["setuptools>=(\d+)"\]', (REPO / "pyproject.toml").read_text())[1]
    for lock in ("cpu", "gpu", "tpu"):
        locked = re.search(r"^setuptools==(\d+)\.", (REPO / "locks" / f"{lock}.txt").read_text(), re.M)
        assert locked and int(locked[1]) >= int(build), lock


def test_read_only_checkout_is_refused_before_anything_is_installed(tmp_path):
    repo = Path(tempfile.mkdtemp(prefix="tessera-ro-"))  # not under tmp_path: another user must reach it
    try:
        (repo / "src").mkdir()
        shutil.copy(REPO / "setup.sh", repo / "setup.sh")
        for path in (repo / "src", repo):
            path.chmod(0o555)
        command = ["bash", str(repo / "setup.sh")]
        if os.geteuid() == 0:  # root writes anywhere: run as nobody
            if not shutil.which("setpriv"):
                pytest.skip("running as root without setpriv: cannot drop write permission")
            command = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *command]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60,
                              env={"PATH": os.environ["PATH"], "HOME": "/nonexistent"})
        assert proc.returncode == 1
        assert f"cannot write in {repo}" in proc.stderr and "clone the repository into a folder you own" in proc.stderr
        assert not (repo / ".venv").exists()
    finally:
        for path in (repo, repo / "src"):
            path.chmod(0o755)
        shutil.rmtree(repo)


def documented_setup_commands() -> set[tuple[str, ...]]:
    """The arguments of every `bash setup.sh ...` that a user is told to run: README.md, the guides,
    setup.sh's own --help, and the fixes the doctor prints."""
    from tessera.doctor import setup_command

    texts = [(REPO / "README.md").read_text(), (REPO / "setup.sh").read_text()]
    texts += [path.read_text() for path in sorted((REPO / "getting_started").glob("*"))]
    texts += [setup_command(device, mode) for device in ("cpu", "gpu", "tpu") for mode in ("locked", "latest")]
    found = set()
    for text in texts:
        for args in re.findall(r"bash setup\.sh((?: +(?:[A-Z_]+=[^\s`\"'&;)]+|lock|--help))*)", text):
            # the Dockerfile's build argument: tpu by default, gpu as its comment shows
            found |= {tuple(args.replace("${DEVICE}", device).split()) for device in ("tpu", "gpu")}
    return found


def test_every_documented_setup_command_is_accepted_and_does_what_it_says(tmp_path):
    commands = documented_setup_commands()
    assert {(), ("DEVICE=gpu",), ("DEVICE=tpu",), ("HF_REFERENCE=1",), ("MODE=latest",), ("--help",)} <= commands
    tools = tools_dir(tmp_path)
    stub_python(tools, "3.11", "python3.11")  # for HF_REFERENCE=1
    for args in sorted(commands):
        if "lock" in args:
            continue  # rewrites locks/ with uv from PyPI: a maintainer's command
        # the placeholder of the no-Python message, or the newer Python it found (a shell variable in setup.sh)
        if "PYTHON=/path/to/python3.12" in args or any(a.startswith("PYTHON=$") for a in args):
            args = tuple(f"PYTHON={stub_python(tmp_path / 'py', '3.12')}" if a.startswith("PYTHON=") else a
                         for a in args)
        venv, hf_venv = tmp_path / "venv", tmp_path / "hf"
        shutil.rmtree(hf_venv, ignore_errors=True)
        stub_venv(venv, "3.12")
        (venv / "pip.log").unlink(missing_ok=True)
        (venv / "tessera-setup.txt").unlink(missing_ok=True)  # DEVICE=gpu's, which another DEVICE refuses to reuse
        proc = run_setup(*args, env={"PATH": str(tools), "HOME": str(tmp_path), "VENV": str(venv),
                                     "HF_VENV": str(hf_venv)})
        assert proc.returncode == 0, f"bash setup.sh {' '.join(args)}: {proc.stderr}"
        if "--help" in args:
            continue
        settings = dict(a.split("=", 1) for a in args)
        device, mode = settings.get("DEVICE", "cpu"), settings.get("MODE", "locked")
        log = (venv / "pip.log").read_text()
        if mode == "locked":
            assert f"install -q -r locks/{device}.txt" in log
        else:
            assert f"install -q --upgrade -r requirements{'' if device == 'cpu' else '-' + device}.txt" in log
        assert (venv / "tessera-setup.txt").read_text() == f"DEVICE={device}\nMODE={mode}\n"
        assert (hf_venv / "pip.log").exists() == (settings.get("HF_REFERENCE") == "1")


def test_started_with_sh_it_runs_under_bash(tmp_path):
    """`sh setup.sh` stopped at once under dash with "set: Illegal option -o pipefail" (exit 2)."""
    proc = subprocess.run(["sh", str(REPO / "setup.sh"), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "MODE=locked|latest" in proc.stdout and proc.stderr == "", proc.stderr
    assert "BASH_VERSION" not in proc.stdout  # the help ends with the settings
    py = stub_python(tmp_path / "py", "3.12")
    proc = subprocess.run(["sh", str(REPO / "setup.sh"), f"PYTHON={py}", f"VENV={tmp_path / 'venv'}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "install -q -r locks/cpu.txt" in (tmp_path / "venv" / "pip.log").read_text()


def test_a_setting_from_the_environment_is_named_as_such(tmp_path):
    """node-gyp's users export PYTHON=python3: setup.sh took it, and refused a 3.10 there without saying where
    'python3' came from (the user had typed only `bash setup.sh`)."""
    old = stub_python(tmp_path / "py", "3.10", "python3")
    proc = run_setup(f"VENV={tmp_path / 'venv'}", env={"PYTHON": str(old)})
    assert proc.returncode == 1
    assert (f"PYTHON={old} is not a usable Python >= 3.11 with venv (version: 3.10) (set in your environment, not on "
            "the command line: unset PYTHON for the default)") in proc.stderr
    proc = run_setup(f"VENV={tmp_path / 'venv'}", f"PYTHON={old}")  # typed: nothing to explain
    assert proc.returncode == 1 and "is not a usable Python" in proc.stderr and "environment" not in proc.stderr
    proc = run_setup(env={"DEVICE": "/dev/sda1"})
    assert proc.returncode == 2
    assert "DEVICE=/dev/sda1 is not one of cpu, gpu, tpu (set in your environment" in proc.stderr
    assert run_setup("DEVICE=fpga", env={"DEVICE": "gpu"}).stderr.strip() == \
        "setup.sh: DEVICE=fpga is not one of cpu, gpu, tpu"


def test_an_environment_installed_for_gpu_is_not_reinstalled_for_another_device(tmp_path):
    """pip removes nothing: the CUDA plugin and libraries stayed in the environment re-installed for cpu."""
    venv = tmp_path / "venv"
    stub_venv(venv, "3.12")
    assert run_setup(f"VENV={venv}", "DEVICE=gpu").returncode == 0
    for device in ("cpu", "tpu"):
        proc = run_setup(f"VENV={venv}", f"DEVICE={device}")
        assert proc.returncode == 1
        assert (f"{venv} was installed for DEVICE=gpu, and its CUDA packages would stay in a DEVICE={device} "
                f"environment; delete it (rm -rf {venv})") in proc.stderr
    assert (venv / "tessera-setup.txt").read_text() == "DEVICE=gpu\nMODE=locked\n"
    assert run_setup(f"VENV={venv}", "DEVICE=gpu", "MODE=latest").returncode == 0  # the same build: reused
    (venv / "tessera-setup.txt").write_text("DEVICE=cpu\nMODE=locked\n")
    assert run_setup(f"VENV={venv}", "DEVICE=gpu").returncode == 0  # cpu to gpu adds the CUDA build


def test_a_reference_setting_without_hf_reference_is_warned_about(tmp_path):
    """TORCH_INDEX_URL=... without HF_REFERENCE=1 installed no reference environment, without a word."""
    venv = tmp_path / "venv"
    stub_venv(venv, "3.12")
    proc = run_setup(f"VENV={venv}", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu")
    assert proc.returncode == 0, proc.stderr
    assert ("setup.sh: warning: TORCH_INDEX_URL is read with HF_REFERENCE=1 only (the reference environment); add "
            "HF_REFERENCE=1 to install it") in proc.stderr
    quiet = run_setup(f"VENV={venv}", env={"TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu"})  # exported
    assert quiet.returncode == 0 and "warning" not in quiet.stderr


def test_a_home_folder_tilde_that_reached_setup_unexpanded_is_the_home_folder(tmp_path):
    """zsh (macOS's shell) passes VENV=~/envs/t as it is: setup.sh made a folder named '~' in the repository."""
    repo, home = tmp_path / "repo", tmp_path / "home"
    repo.mkdir()
    home.mkdir()
    shutil.copy(REPO / "setup.sh", repo / "setup.sh")
    stub_python(home / "py", "3.12", "python3")
    proc = run_setup("VENV=~/envs/t", "PYTHON=~/py/python3", setup_sh=repo / "setup.sh", cwd=tmp_path,
                     env={"HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    assert f"creating {home}/envs/t with {home}/py/python3 (Python 3.12)" in proc.stdout
    assert (home / "envs" / "t" / "pip.log").is_file() and not (repo / "~").exists()


def test_an_environment_in_a_folder_still_to_be_made_is_checked_and_made(tmp_path):
    """VENV=/new/place/venv: df failed on the missing folder, and setup.sh stopped there, exit 1 and not a word."""
    py = stub_python(tmp_path / "py", "3.12")
    venv = tmp_path / "new" / "place" / "venv"
    proc = run_setup(f"PYTHON={py}", f"VENV={venv}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "install -q -r locks/cpu.txt" in (venv / "pip.log").read_text()
    # the disk is still checked: that of the nearest folder that exists (df, like the real one, fails on the others)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "df").write_text("#!/bin/sh\n[ -d \"$2\" ] || exit 1\n"
                                "echo 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                                "echo '/dev/x 1000000 900000 102400 90% /'\n")
    (bin_dir / "df").chmod(0o755)
    other = tmp_path / "other" / "venv"
    proc = run_setup(f"PYTHON={py}", f"VENV={other}", env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert proc.returncode == 1 and f"only 100 MB free on the disk of {tmp_path / 'other'}" in proc.stderr
    assert not other.exists()


def test_an_environment_whose_python_is_gone_is_made_anew_with_a_word(tmp_path):
    """Its interpreter removed (brew upgraded python@3.12, pyenv uninstall): the environment was deleted and made
    again without a line saying why."""
    venv = tmp_path / "venv"
    stub_venv(venv, "3.12")
    (venv / "bin" / "python").unlink()
    (venv / "bin" / "python").symlink_to(tmp_path / "uninstalled" / "python3.12")
    py = stub_python(tmp_path / "py", "3.12")
    proc = run_setup(f"PYTHON={py}", f"VENV={venv}")
    assert proc.returncode == 0, proc.stderr
    assert f"setup.sh: {venv}'s Python does not run" in proc.stdout and "making it anew" in proc.stdout
    assert f"creating {venv} with {py}" in proc.stdout and (venv / "pip.log").is_file()


@pytest.mark.parametrize("system", ["Darwin", "MINGW64_NT-10.0"])
def test_an_accelerator_build_on_a_system_without_it_is_refused(tmp_path, system):
    """On macOS, DEVICE=gpu made the environment, then pip failed: "No matching distribution found for
    jax-cuda12-plugin" (libtpu likewise for DEVICE=tpu)."""
    tools = tools_dir(tmp_path)
    (tools / "uname").unlink()
    (tools / "uname").write_text(f"#!/bin/sh\necho {system}\n")
    (tools / "uname").chmod(0o755)
    stub_python(tools, "3.12", "python3.12")
    env = {"PATH": str(tools), "HOME": str(tmp_path)}
    for device in ("gpu", "tpu"):
        proc = run_setup(f"VENV={tmp_path / 'venv'}", f"DEVICE={device}", env=env)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.strip() == (f"setup.sh: DEVICE={device} needs Linux: JAX's CUDA and TPU builds are made "
                                       f"for Linux only, and this is {system}; use DEVICE=cpu here")
        assert not (tmp_path / "venv").exists()
    assert run_setup(f"VENV={tmp_path / 'venv'}", env=env).returncode == 0  # the CPU build
