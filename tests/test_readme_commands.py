"""The README's and the guides' commands, run as printed from a fresh working directory.

A copy of train.py, decode.py and configs/ goes into an empty folder (the package itself comes
from the install, as after `bash setup.sh`); each command is parsed out of the Markdown, so a
test breaks when a document changes, and runs there with `.venv/bin/python` mapped to this
interpreter. Relative paths (the default `outputs/` folder, `load_parameters_path=outputs/...`,
the converter's folders) therefore resolve against that folder, as on a user's machine.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST_COMPILE, REPO

pytestmark = pytest.mark.slow

PYTHON = ".venv/bin/python"


def doc_commands(doc: str) -> list[list[str]]:
    """Every command of the ```bash blocks of `doc`, continuation lines joined and comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / doc).read_text(), flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [argv for argv in (shlex.split(line, comments=True) for line in lines) if argv]


def doc_command(doc: str, start: str, containing: str = "") -> list[str]:
    """The first command of `doc` that starts with `start` and contains `containing`."""
    for argv in doc_commands(doc):
        text = " ".join(argv)
        if text.startswith(start) and containing in text:
            return argv
    raise AssertionError(f"{doc} no longer prints a command starting with {start!r} containing {containing!r}")


def quick_start_command() -> list[str]:
    section = (REPO / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    line = next(line for line in section.splitlines() if line.startswith(f"{PYTHON} train.py"))
    return shlex.split(line, comments=True)


def run_in(cwd: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """`argv` as a user would type it in `cwd`: one CPU device, XLA's usual optimization, no M_<KEY>
    variables of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
    flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    env["XLA_FLAGS"] = flags.replace(FAST_COMPILE, "").strip()
    argv = [sys.executable if a == PYTHON else a for a in argv]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A fresh folder after the quick start's training command: (folder, the finished process)."""
    cwd = tmp_path_factory.mktemp("fresh_machine")
    for name in ("train.py", "decode.py"):
        shutil.copy(REPO / name, cwd / name)
    shutil.copytree(REPO / "configs", cwd / "configs")
    return cwd, run_in(cwd, quick_start_command())


def test_quick_start_trains_into_outputs_demo(demo):
    cwd, proc = demo
    assert quick_start_command()[:4] == [PYTHON, "train.py", "configs/base.yml", "run_name=demo"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = cwd / "outputs" / "demo"
    assert (run_dir / "report.json").is_file() and (run_dir / "config.yml").is_file()
    assert (run_dir / "checkpoints" / "150" / "state").is_dir()
    assert "Traceback" not in proc.stderr and "Metadata file does not exist" not in proc.stderr
    assert "config (differs from base.yml): run_name=demo\n" in proc.stderr
    assert not (run_dir / "xla_dump").exists()  # dump_hlo is off by default (test_xla_dump turns it on)


def test_quick_start_numbers_are_the_readmes(demo):
    """The README's figures of the demo: its parameter count, the step line it prints (step 100's loss)
    and the final loss; a change of the model, the data or the schedule that moves them fails here."""
    import json

    cwd, _ = demo
    readme = " ".join((REPO / "README.md").read_text().split())
    run_dir = cwd / "outputs" / "demo"
    report = json.loads((run_dir / "report.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    millions = float(re.search(r"trains a ([\d.]+)M-parameter Llama", readme).group(1))
    assert round(report["num_parameters"] / 1e6, 1) == millions
    step, loss = re.search(r"step +(\d+) \| loss (\d+\.\d+) \|", readme).groups()
    assert abs(losses[int(step)] - float(loss)) < 0.01, (step, losses[int(step)], loss)
    final = float(re.search(r"final loss (\d+\.\d+)", readme).group(1))
    assert abs(report["final_loss"] - final) < 0.01, (report["final_loss"], final)


def test_quick_start_again_has_nothing_to_do(demo):
    cwd, _ = demo
    report = (cwd / "outputs" / "demo" / "report.json").read_text()
    proc = run_in(cwd, quick_start_command())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to do: the run is already at step 150 of 150" in proc.stderr
    assert "train step compiled" not in proc.stderr
    assert (cwd / "outputs" / "demo" / "report.json").read_text() == report


def _decode(cwd: Path, checkpoint: str) -> list[str]:
    argv = doc_command("getting_started/Decode.md", f"{PYTHON} decode.py", "load_parameters_path=outputs/demo")
    argv = [f"load_parameters_path={checkpoint}" if a.startswith("load_parameters_path=") else a for a in argv]
    proc = run_in(cwd, argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


@pytest.fixture(scope="module")
def demo_tokens(demo):
    """Decode.md's command on the quick start's last checkpoint, as printed (a relative step folder)."""
    return _decode(demo[0], "outputs/demo/checkpoints/150")


def test_decode_guide_command(demo_tokens):
    assert len(demo_tokens) == 16 and all(t.isdigit() for t in demo_tokens)


def test_convert_round_trip_with_relative_folders(demo, demo_tokens):
    """tessera-to-hf, then hf-to-tessera, as Models.md prints them (module and subcommand), with
    the demo's relative folders; the converted checkpoint decodes to the same tokens."""
    cwd, _ = demo
    for subcommand, source, target in (("tessera-to-hf", "outputs/demo/checkpoints/150", "demo-hf"),
                                       ("hf-to-tessera", "demo-hf", "demo-tessera")):
        program = doc_command("getting_started/Models.md", f"{PYTHON} -m tessera.tools.convert {subcommand}")[:4]
        proc = run_in(cwd, [*program, source, target, "model_name=default"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        # stderr is not a terminal: no progress-bar frames, no Orbax warnings; only Tessera's own info lines
        assert all(re.match(r"\d\d:\d\d:\d\d I ", line) for line in proc.stderr.splitlines()), proc.stderr[-3000:]
        assert subcommand == "hf-to-tessera" or "checksums of " in proc.stderr  # the checksums it verified
    assert (cwd / "demo-hf" / "config.json").is_file()
    assert _decode(cwd, "demo-tessera") == demo_tokens


def test_the_test_command_ends_with_a_failure_when_a_worker_dies(tmp_path):
    """The README's test command, with the project's pytest settings, over two files, the first test of one
    killing its worker: the run ends, failed, naming that test, and that file is not run again by a replacement
    worker (xdist's default replaced it; in full runs where XLA:CPU crashed a worker, the run then hung)."""
    argv = doc_command("README.md", f"{PYTHON} -m pytest -q -n auto tests")
    assert argv[-1] == "tests"
    (tmp_path / "test_dies.py").write_text("import os, signal\n\ndef test_dies():\n"
                                           "    os.kill(os.getpid(), signal.SIGKILL)\n\ndef test_after():\n    pass\n")
    (tmp_path / "test_lives.py").write_text("def test_lives():\n    pass\n")
    argv = [sys.executable if a == PYTHON else a for a in argv[:-1]]
    proc = subprocess.run([*argv, "-n", "2", "-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"),
                           "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    # one worker went down, and no other took its file up (pytest's summary repeats the failure's line in full or
    # cut to the terminal's width, so the lines are counted by xdist's own "node down")
    assert out.count("node down:") == 1 and "replacing crashed worker" not in out, out[-3000:]
    assert re.search(r"worker 'gw\d' crashed while running 'test_dies.py::test_dies'", out), out[-3000:]
    assert "1 failed, 1 passed" in out, out[-3000:]
