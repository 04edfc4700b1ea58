"""The benchmark scripts' command lines: `--help` answers without measuring or writing anything, and
a bad argument (a count below its least, an unknown trainer key, a stray word, a recipe filter that
matches nothing, an `--out` that cannot be written) is argparse's usage line and one error line,
exit code 2, before anything is measured or written."""

import hashlib
import os
import subprocess
import sys

import pytest

from conftest import REPO

BENCH = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name != "bench_cli.py")
WITH_OUT = ("checkpoint_blocking.py", "cpu_llama.py", "cpu_llama_ceiling.py", "data_pipeline.py", "decode_memory.py",
            "delta_rule.py", "host_memory.py", "host_overhead.py", "pipeline.py", "splash_mask_tables.py")


def _results() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (BENCH / "results").glob("*.json")}


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def test_every_script_is_covered():
    assert set(WITH_OUT) | {"aot_recipes.py", "plan_recipes.py"} == set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_answers_and_writes_nothing(script):
    before = _results()
    proc = _run(script, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: ") and "wrote" not in proc.stdout
    assert _results() == before


BAD = [
    ("cpu_llama.py", ["--steps", "0"], "argument --steps: 0 is too small; give at least 1"),
    ("cpu_llama.py", ["--steps", "2"], "--steps 2 leaves no step after the 2 warm-up step(s)"),
    ("cpu_llama.py", ["--steps", "4", "report_warmup_steps=4"], "give --steps 5 or more"),
    ("cpu_llama.py", ["bogus_key=1"], "unknown config key 'bogus_key'"),
    ("cpu_llama.py", ["learning_rate=-1"], "learning_rate='-1' is too small"),
    ("cpu_llama.py", ["stray"], "unrecognized arguments: stray"),
    ("cpu_llama.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("cpu_llama.py", ["dtype=float16"], "dtype=float16: this benchmark measures float32 and bfloat16"),
    ("cpu_llama.py", ["base_emb_dim=128"], "cannot be overridden: ['base_emb_dim']"),
    ("cpu_llama.py", ["steps=2"], "steps=2: the number of steps is the option --steps (give --steps 2)"),
    ("cpu_llama.py", ["base_output_directory=out"], "base_output_directory=out: each run trains in a temporary"),
    ("cpu_llama_ceiling.py", ["--repeats", "0"], "argument --repeats: 0 is too small"),
    ("cpu_llama_ceiling.py", ["learning_rat=0.1"], "unknown config key 'learning_rat'"),
    ("cpu_llama_ceiling.py", ["dtype=float16"], "dtype=float16"),
    ("delta_rule.py", ["--rounds", "0"], "argument --rounds: 0 is too small"),
    ("host_overhead.py", ["--rounds", "0"], "argument --rounds: 0 is too small"),
    ("host_overhead.py", ["--steps", "10"], "argument --steps: 10 is too small; give at least 11"),
    ("host_overhead.py", ["--steps", "x"], "argument --steps: 'x' is not a whole number"),
    ("host_overhead.py", ["--out="], "--out is empty; give the path of a .json file"),
    ("pipeline.py", ["--steps", "2"], "argument --steps: 2 is too small; give at least 3"),
    ("pipeline.py", ["--rounds", "-1"], "argument --rounds: -1 is too small"),
    ("host_memory.py", ["--rounds", "0"], "argument --rounds: 0 is too small"),
    ("aot_recipes.py", ["no_such_recipe"], "no recipe's path contains 'no_such_recipe'"),
    ("aot_recipes.py", ["v5p/128b", "--bogus"], "unrecognized arguments: --bogus"),
    ("plan_recipes.py", ["v6e", "v7x"], "no recipe's path contains 'v7x'"),
]


@pytest.mark.parametrize("script, args, message", BAD, ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD])
def test_bad_argument_is_one_error_line_and_exit_2(script, args, message, tmp_path):
    before = _results()
    out = [] if script in ("aot_recipes.py", "plan_recipes.py") else ["--out", str(tmp_path / "r.json")]
    proc = _run(script, *out, *args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith(f"usage: {script}") and len(lines) <= 3, proc.stderr[-2000:]
    assert lines[-1].startswith(f"{script}: error: ") and message in lines[-1], lines[-1]
    assert "Traceback" not in proc.stderr and "matmul peak" not in proc.stdout
    assert not (tmp_path / "r.json").exists() and _results() == before


@pytest.mark.parametrize("script", WITH_OUT)
def test_out_that_cannot_be_written_is_refused_first(script, tmp_path):
    (tmp_path / "afile").write_text("")
    for out, message in ((tmp_path / "afile" / "r.json", f"--out {tmp_path / 'afile' / 'r.json'}: "
                                                         f"{tmp_path / 'afile'} is a file, not a folder"),
                         (tmp_path, f"--out {tmp_path} is a folder; give the path of a .json file")):
        proc = _run(script, "--out", str(out))
        assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines()[-1].startswith(f"{script}: error: {message}"), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


def test_every_script_runs_its_main_through_run_main():
    for script in SCRIPTS:
        tail = (BENCH / script).read_text().split('if __name__ == "__main__":')[-1]
        assert "sys.exit(run_main(main" in tail, script


def test_a_stopped_run_is_one_line_and_its_exit_code_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C while a benchmark measures outside the trainer (a matmul peak, a compile) exits 130, and
    SIGTERM or Ctrl-C during the trainer's loop (which raises `TrainingStopped` after the step in flight)
    exits with 128 + the signal's number; before, both were tracebacks with exit code 1."""
    monkeypatch.syspath_prepend(str(BENCH))
    from bench_cli import run_main
    from tessera.stop_signals import TrainingStopped

    def interrupted():
        raise KeyboardInterrupt

    def stopped():
        raise TrainingStopped("stopped by SIGTERM after step 7 (checkpointing is off: nothing saved)", 143)

    assert run_main(interrupted) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C): no results written (exit code 130)\n"
    assert run_main(stopped) == 143
    assert capsys.readouterr().err == ("stopped by SIGTERM after step 7 (checkpointing is off: nothing saved): the "
                                       "benchmark ends here, no results written (exit code 143)\n")
    assert run_main(lambda argv: len(argv), ["a", "b"]) == 2
    with pytest.raises(ValueError):  # a real failure keeps its traceback
        run_main(lambda: int("x"))


def test_sigterm_outside_the_trainer_is_one_line_and_exit_143():
    """SIGTERM while a script measures outside the trainer (a matmul peak, a child's compile) was the
    default action: the process vanished without a word."""
    code = ("import os, signal, sys, time; from bench_cli import run_main; "
            "sys.exit(run_main(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=BENCH)
    assert proc.returncode == 143, (proc.returncode, proc.stderr)
    assert proc.stderr == "stopped by SIGTERM: no results written (exit code 143)\n"


def test_a_signal_while_host_memory_waits_for_its_run_stops_the_run(tmp_path):
    """host_memory waits for its train.py run with wait4 (for the peak memory): SIGTERM to the benchmark exited
    143 and left the run training on alone, holding gigabytes."""
    fake = tmp_path / "python"  # stands in for the interpreter that runs train.py: says its pid, then trains long
    fake.write_text(f"#!/usr/bin/env bash\necho $$ > {tmp_path / 'pid'}\nexec sleep 60\n")
    fake.chmod(0o755)
    code = ("import os, signal, sys, threading, time; from pathlib import Path; import host_memory; "
            "from bench_cli import run_main\n"
            f"sys.executable = {str(fake)!r}; pid = Path({str(tmp_path / 'pid')!r})\n"
            "def stop():\n    while not pid.exists() or not pid.read_text().strip(): time.sleep(0.05)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "threading.Thread(target=stop, daemon=True).start()\n"
            f"sys.exit(run_main(host_memory.train, Path({str(tmp_path)!r}), 'x', {{}}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=BENCH)
    assert proc.returncode == 143, (proc.returncode, proc.stderr)
    child = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(child, 0)
