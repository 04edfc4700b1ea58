"""Every entry point answers --help and -h at once (usage, its most-used keys, the files that
document the rest; exit 0; JAX never imported), and the shared command-line helpers: options,
paths relative to the working directory, progress lines."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from conftest import REPO, TINY
from tessera.tools.cli import Heartbeat, UsageError, format_seconds, resolve_path, take_options
from tessera.tools.cli_signals import sigterm_raises

ENTRY_POINTS = {
    "train.py": ["train.py"],
    "decode.py": ["decode.py"],
    "tessera.decode": ["-m", "tessera.decode"],
    "tessera.train_compile": ["-m", "tessera.train_compile"],
    "tessera.tools.convert": ["-m", "tessera.tools.convert"],
    "tessera.tools.check_logits": ["-m", "tessera.tools.check_logits"],
    "tessera.tools.validate": ["-m", "tessera.tools.validate"],
    "tessera.tools.estimate": ["-m", "tessera.tools.estimate"],
    "tessera.tools.plan": ["-m", "tessera.tools.plan"],
    "tessera.config": ["-m", "tessera.config"],
    "tessera.doctor": ["-m", "tessera.doctor"],
    "tessera.gpu_tuning": ["-m", "tessera.gpu_tuning"],
}
DOCUMENTS = re.compile(r"(?:getting_started/[\w.-]+\.md|configs/base\.yml|README\.md)")


def _imports_and_lines(stderr: str) -> tuple[set[str], list[str]]:
    """A `python -X importtime` run's stderr: (the modules it imported, its other lines)."""
    lines = stderr.splitlines()
    return ({line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time")},
            [line for line in lines if not line.startswith("import time")])


def _run(args, cwd=REPO, **env):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **env}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_without_jax(name, flag):
    proc = _run(["-X", "importtime", *ENTRY_POINTS[name], flag])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:300]
    named = DOCUMENTS.findall(proc.stdout)
    assert named, f"{name} --help names no guide or configs/base.yml"
    for document in named:
        assert (REPO / document).is_file(), document
    imported, _ = _imports_and_lines(proc.stderr)
    assert "jax" not in imported, f"{name} {flag} imported JAX"


def _untimed(lines):
    return [re.sub(r"^\d\d:\d\d:\d\d ", "", line) for line in lines]  # the log lines' time of day


def test_a_config_error_ends_train_py_before_jax_is_imported(capsys):
    """The same lines as main's (a note, then the error; exit code 2), without the seconds JAX, Flax
    and Orbax take to import."""
    from tessera.train import main

    argv = ["configs/base.yml", "steps=5", "steps=6", "learning_rat=0.1"]
    proc = _run(["-X", "importtime", "train.py", *argv])
    imported, said = _imports_and_lines(proc.stderr)
    assert proc.returncode == 2 and "jax" not in imported and "tessera.train" not in imported
    assert main(argv) == 2
    in_process = capsys.readouterr().err.splitlines()
    assert _untimed(said) == _untimed(in_process) and len(said) == 2
    assert said[0].endswith(" I steps is given twice on the command line (steps=5, then steps=6); the last is used")
    assert said[1].startswith("config error: unknown config key 'learning_rat' in the command line; did you mean")


@pytest.mark.parametrize("args", [
    ["configs/base.yml", "steps=5", "steps=6", "learnin_rate=0.1", "--tokens", "1,2"],  # a config key: a note, then it
    ["configs/base.yml", "--tokens", "1,2", "--max-new-tokens", "5"],  # a flag
    ["nowhere.yml", "--tokens", "1,2"],  # the config file
    ["configs/base.yml", "--tokens", "1,2"],  # no load_parameters_path
])
def test_an_argument_error_ends_decode_py_before_jax_is_imported(capsys, args):
    """The same lines and exit code as decode's main, without the 2 s that importing JAX and Tessera's
    model code took first."""
    from tessera.decode import main

    proc = _run(["-X", "importtime", "decode.py", *args])
    imported, said = _imports_and_lines(proc.stderr)
    assert proc.returncode == 2 and "jax" not in imported and "tessera.decode" not in imported, proc.stderr[-2000:]
    if "--max-new-tokens" in args:  # argparse's exit
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 2
    else:
        assert main(args) == 2
    assert _untimed(said) == _untimed(capsys.readouterr().err.splitlines()) and said, said
    assert "error: " in said[-1] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, error", [
    (["configs/base.yml", "compile_topology=v5e-4", "learnin_rate=1"], "config error: unknown config key"),
    (["configs/base.yml", "compile_topology=v9-4"], "config error: compile_topology='v9-4' is not a TPU slice type"),
    (["configs/base.yml"], "config error: compile_topology is empty"),  # 5 s, after JAX had started, for these two
    (["nowhere.yml", "compile_topology=v5e-4"], "error: config file "),
])
def test_a_config_error_ends_train_compile_before_jax_is_imported(capsys, args, error):
    from tessera.train_compile import main

    proc = _run(["-X", "importtime", "-m", "tessera.train_compile", *args])
    imported, said = _imports_and_lines(proc.stderr)
    assert proc.returncode == 2 and "jax" not in imported, proc.stderr[-2000:]
    assert said[-1].startswith(error) and "Traceback" not in proc.stderr, said
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines()[-1] == said[-1]


def test_train_main_answers_help_first(capsys):
    from tessera.train import main

    with pytest.raises(SystemExit) as exit_:
        main(["configs/base.yml", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: .venv/bin/python train.py")
    assert "steps=150" in out and "per_device_batch_size=" in out  # keys with their defaults
    # a key's comment is read apart from base.yml here: remat_policy's said "the per-tensor keys below", none below
    assert "below" not in out and "'custom': the per-tensor keys decoder_layer_input to mlpwo" in out


def test_a_relative_path_of_the_repository_typed_elsewhere_names_the_repositorys(tmp_path, monkeypatch):
    """decode.py configs/base.yml ... from another folder said only "check the path"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as error:
        resolve_path("configs/base.yml", "config file")
    assert str(error.value) == (
        f"config file {tmp_path / 'configs' / 'base.yml'} does not exist ('configs/base.yml' from the working "
        f"directory {tmp_path}); the repository's is {REPO / 'configs' / 'base.yml'}: run the command from {REPO}, as the docs "
        "do, or give that path")
    with pytest.raises(UsageError, match=r"\('configs/bse.yml' from the working directory .*\); check the path$"):
        resolve_path("configs/bse.yml", "config file")


@pytest.mark.parametrize("script", ["train.py", "decode.py"])
def test_a_python_without_the_packages_is_told_which_interpreter_to_use(script):
    """`python3 train.py ...` with a Python other than the project's was a ModuleNotFoundError traceback
    ("No module named 'jax'"); -S leaves this interpreter without its site-packages, as such a Python is."""
    proc = subprocess.run([sys.executable, "-S", str(REPO / script), "configs/base.yml", "run_name=x"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and "has no module '" in line and "which Tessera needs" in line, line
    assert f"python {script} ..." in line, line


@pytest.mark.parametrize("script, variable, said", [
    ("train.py", "JAX_OPTIMIZATION_LEVEL=o1", 'Invalid value "o1" for JAX flag jax_optimization_level'),
    ("decode.py", "JAX_ENABLE_PGLE=maybe", "invalid truth value 'maybe' for environment 'JAX_ENABLE_PGLE'")])
def test_a_jax_variable_jax_cannot_read_is_one_config_error(script, variable, said):
    """JAX_OPTIMIZATION_LEVEL=o1 (the GPU docs' variable; JAX takes O1) ended `import jax` in a ValueError traceback,
    exit code 1."""
    name, _, value = variable.partition("=")
    # a config each script reads without an error: decode.py checks load_parameters_path before importing JAX
    keys = ["run_name=x"] if script == "train.py" else ["load_parameters_path=outputs/x/checkpoints/1"]
    proc = subprocess.run([sys.executable, str(REPO / script), "configs/base.yml", *keys], capture_output=True,
                          text=True, cwd=REPO, timeout=60, env={**os.environ, name: value})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"config error: {variable} in the environment is a value JAX cannot read ({said}); correct it or unset it"]


def test_options_of_convert_and_check_logits():
    defaults = {"--tokens": "", "--max-kl": "1e-4"}
    values, rest = take_options(["hf", "--tokens", "1,2", "ckpt", "--max-kl=0.1", "model_name=x"], defaults)
    assert values == {"--tokens": "1,2", "--max-kl": "0.1"} and rest == ["hf", "ckpt", "model_name=x"]
    assert take_options(["a"], defaults) == (defaults, ["a"])
    with pytest.raises(UsageError, match="unknown option --max_kl; the options are --tokens, --max-kl"):
        take_options(["--max_kl", "1"], defaults)
    with pytest.raises(UsageError, match="--tokens needs a value"):
        take_options(["a", "--tokens"], defaults)


def test_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    assert resolve_path("ckpt", "checkpoint") == str(tmp_path / "ckpt")
    assert resolve_path("sub/../ckpt", "checkpoint") == str(tmp_path / "ckpt")
    assert resolve_path("gs://bucket/ckpt", "checkpoint") == "gs://bucket/ckpt"
    assert resolve_path("new_out", "output folder", must_exist=False) == str(tmp_path / "new_out")
    with pytest.raises(UsageError, match=f"checkpoint {tmp_path / 'nope'} does not exist"):
        resolve_path("nope", "checkpoint")



def test_an_empty_path_a_file_url_and_a_too_long_name_are_refused(tmp_path, monkeypatch):
    """convert tessera-to-hf <ckpt> "" wrote into the working directory (or said "/repo is not empty");
    a file:///... checkpoint ended in etils' KeyError: 'file://' traceback, exit code 1."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"^the output folder is an empty string \(''\); give a path$"):
        resolve_path("", "output folder", must_exist=False)
    with pytest.raises(UsageError, match=r"^the checkpoint is an empty string"):
        resolve_path(" ", "checkpoint")
    with pytest.raises(UsageError) as e:
        resolve_path("file:///ck%20pt/4", "checkpoint")
    assert str(e.value) == ("checkpoint file:///ck%20pt/4 is a file: URL, which is not read as a local path; write "
                            "the path itself, /ck pt/4")
    with pytest.raises(UsageError, match=f"write the path itself, {tmp_path}/out$"):
        resolve_path("file:out", "output folder", must_exist=False)
    with pytest.raises(UsageError) as e:  # was an OSError traceback, or "writing failed: File name too long"
        resolve_path("c" * 300, "checkpoint")
    assert str(e.value) == (f"the checkpoint {tmp_path}/{'c' * 20}... has a file or folder name of 300 bytes, and "
                            "file systems take names of at most 255 bytes; use a shorter name")

def test_convert_with_relative_paths(tmp_path):
    """Orbax needs absolute paths: relative ones typed by a user are resolved first."""
    from tessera.config import build_config
    from tessera.models import build_model
    from tessera.tools import hf_checkpoint

    model = build_model(build_config(TINY).model)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), model.param_shapes())
    hf_checkpoint.save_params(tmp_path / "ckpt", params)
    keys = [f"{k}={v}" for k, v in TINY.items()]
    proc = _run(["-m", "tessera.tools.convert", "tessera-to-hf", "ckpt", "hf_out", *keys], cwd=tmp_path,
                JAX_PLATFORMS="cpu", XLA_FLAGS="")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "hf_out" / "config.json").is_file() and str(tmp_path / "hf_out") in proc.stdout
    proc = _run(["-m", "tessera.tools.convert", "tessera-to-hf", "missing", "out2", *keys], cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"checkpoint {tmp_path / 'missing'} does not exist" in proc.stderr


def test_bad_command_lines_exit_2_without_traceback(tmp_path):
    (tmp_path / "listed").mkdir()  # a config.json holding a JSON array ended in an AttributeError traceback
    (tmp_path / "listed" / "config.json").write_text("[]")
    (tmp_path / "ckpt").mkdir()
    not_object = f"{tmp_path / 'listed' / 'config.json'} holds a JSON list, not an object of model settings"
    cases = {
        ("-m", "tessera.tools.convert", "hf-to-tessera", "only_one"): "give hf-to-tessera or tessera-to-hf",
        ("-m", "tessera.tools.check_logits", "a", "b", "--max-kl", "x"): "--max-kl 'x' is not a number",
        # nan or a negative bound failed every position (exit 1, "logits differ") whatever the logits
        ("-m", "tessera.tools.check_logits", "a", "b", "--max-kl", "nan"): "--max-kl nan must be a finite number >= 0",
        ("-m", "tessera.tools.check_logits", "a", "b", "--max-abs-diff", "-1"): "--max-abs-diff -1 must be a finite",
        ("-m", "tessera.tools.convert", "hf-to-tessera", "listed", "out"): not_object,
        ("-m", "tessera.tools.check_logits", "listed", "ckpt", "model_name=default"): not_object,
        ("-m", "tessera.tools.check_logits", "nowhere", "b"): f"Hugging Face folder {tmp_path / 'nowhere'} does not",
        ("-m", "tessera.tools.validate", "none.json"): f"validation file {tmp_path / 'none.json'} does not exist",
        ("-m", "tessera.config", "none.yml"): f"config file {tmp_path / 'none.yml'} does not exist",
    }
    for args, message in cases.items():
        proc = _run(args, cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)


def test_config_prints_the_resolved_config_or_base_yml():
    proc = _run(["-m", "tessera.config", "configs/base.yml", "model_name=llama3.1-8b", "steps=7"], M_RUN_NAME="r1")
    assert proc.returncode == 0, proc.stderr
    assert "steps: 7\n" in proc.stdout and "run_name: r1\n" in proc.stdout and "base_emb_dim: 4096\n" in proc.stdout
    assert _run(["-m", "tessera.config"]).stdout == (REPO / "configs" / "base.yml").read_text()


def test_a_printed_config_given_back_as_a_config_file_is_read_as_it_stands(tmp_path):
    """The printed config, saved and given back, trained the model file's 32 layers, not the 4 it printed:
    a config file's keys lose to the model file's, and 4 (the default) was not warned about either."""
    proc = _run(["-m", "tessera.config", "configs/base.yml", "model_name=llama2-7b", "base_num_decoder_layers=4"])
    assert proc.returncode == 0 and "base_num_decoder_layers: 4\n" in proc.stdout, proc.stderr
    (tmp_path / "mine.yml").write_text(proc.stdout)
    again = _run(["-m", "tessera.config", str(tmp_path / "mine.yml")])
    assert again.returncode == 0 and again.stdout == proc.stdout, again.stderr


def test_config_says_on_stderr_which_maxtext_spellings_it_read():
    """tessera.config printed eval_interval: 0 for eval_interval=-1 and, for sequence_length=abc, an error naming
    max_target_length only: the lines train.py logs (aliases, MaxText's spellings) went nowhere."""
    proc = _run(["-m", "tessera.config", "configs/base.yml", "eval_interval=-1"])
    assert proc.returncode == 0 and "eval_interval: 0\n" in proc.stdout and "MaxText" not in proc.stdout
    assert "eval_interval='-1' is MaxText's spelling of never evaluate; using eval_interval=0" in proc.stderr
    proc = _run(["-m", "tessera.config", "configs/base.yml", "sequence_length=abc"])
    last = proc.stderr.splitlines()[-2:]
    assert proc.returncode == 2 and last[0].endswith(" I sequence_length=abc is the GPU validation files' name for "
                                                     "max_target_length; using that"), proc.stderr
    assert last[1] == "config error: max_target_length='abc' is not a valid int (from the command line)"


def test_heartbeat_says_how_long_until_the_block_ends():
    lines = []
    with Heartbeat("compiling", period=0.05, detail=lambda: "step 3/8", emit=lines.append):
        time.sleep(0.4)
    count = len(lines)
    assert count >= 2 and lines[0] == "compiling: 0s elapsed, step 3/8"
    time.sleep(0.2)
    assert len(lines) == count  # the thread stopped with the block
    assert [format_seconds(s) for s in (45, 125, 3720)] == ["45s", "2m05s", "1h02m"]



def test_a_sigterm_whose_exception_a_gc_callback_swallowed_is_delivered_again():
    """The handler ran inside a garbage-collection callback, where Python reports its exception as
    "ignored": the signal is sent again and the block still stops (CI once saw train.py train to the
    end and exit 0 after a SIGTERM at start-up)."""
    import gc

    class Stop(BaseException):
        pass

    fired, reached = [], []

    def callback(phase, info):
        if phase == "start" and not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10_000):  # the handler runs in here: its exception goes to sys.unraisablehook
                pass

    hook = sys.unraisablehook
    gc.callbacks.append(callback)
    try:
        with pytest.raises(Stop), sigterm_raises(Stop):
            gc.collect()
            reached.append(True)
            time.sleep(5)  # the signal sent again arrives here and raises
    finally:
        gc.callbacks.remove(callback)
    assert fired and reached == [True]  # it got past the collection: the first signal was swallowed there
    assert sys.unraisablehook is hook


def test_sigterm_raises_only_inside_its_block_and_restores_the_previous_handler():
    class Stop(BaseException):
        pass

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stop):
        with sigterm_raises(Stop):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler interrupts this at once
    assert signal.getsignal(signal.SIGTERM) is before


# Where the signal arrives: in the computation, or first inside a garbage-collection callback (as JAX
# registers one), where Python swallows the handler's exception, and the signal sent again then
# finds the main thread in the computation (CI once saw that process ignore Ctrl-C for good).
GC_CALLBACK_FIRST = (
    "import gc, time\n"
    "import tessera.tools.cli\n"
    "tessera.tools.cli_signals.RESEND_SECONDS = 1.0  # sent again once the main thread is surely in the computation\n"
    "armed = [True]\n"
    "def callback(phase, info):\n"
    "    if phase == 'start' and armed[0]:\n"
    "        armed[0] = False\n"
    "        pathlib.Path(READY).touch()\n"
    "        time.sleep(5)  # the signal's handler runs here; its exception is reported as ignored\n"
    "gc.callbacks.append(callback)\n"
    "gc.collect()\n")


@pytest.mark.parametrize("where", ["computation", "gc callback, then computation"])
@pytest.mark.parametrize("signum, code, what", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                               (signal.SIGINT, 130, "interrupted (Ctrl-C)")])
@pytest.mark.slow
def test_a_signal_stops_a_process_whose_main_thread_is_blocked_in_compiled_code(tmp_path, signum, code, what, where):
    """Python runs signal handlers between bytecodes only: while the main thread waits on a device
    (here a computation that never ends; in the field, XLA compiling or an allocation that hung
    under `ulimit -v`), the handler cannot run, and the process used to ignore SIGTERM and Ctrl-C
    for as long. The watcher thread ends it `grace` seconds later with one line and 128 + the signal."""
    script, ready = tmp_path / "blocked.py", tmp_path / "ready"
    script.write_text(
        "import pathlib, signal, sys\n"
        # Ctrl-C as a process started from a terminal has it: a test run started in the background
        # (`nohup ... &`) passes SIGINT on ignored, and a process that inherits it ignored keeps it so
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import jax\n"
        "from tessera.tools.cli_signals import sigterm_raises\n"
        f"READY = {str(ready)!r}\n"
        "class Stop(BaseException): pass\n"
        "spin = jax.jit(lambda step: jax.lax.while_loop(lambda c: c >= 0, lambda c: c + step, 0))\n"
        "spin(-1).block_until_ready()  # compiled (it ends at once): spin(0) below only dispatches\n"
        "with sigterm_raises(Stop, grace=2):\n"
        "    try:\n"
        + textwrap.indent(GC_CALLBACK_FIRST if where.startswith("gc") else "pathlib.Path(READY).touch()\n", " " * 8) +
        "        spin(0).block_until_ready()\n"
        "    except (Stop, KeyboardInterrupt):\n"
        "        print('the handler ran', file=sys.stderr)\n"
        "        sys.exit(1)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True, env=env)
    try:  # the process never ends by itself: it is killed whatever happens here
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the script did not reach its computation"
        time.sleep(1)  # into the computation
        proc.send_signal(signum)
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == code, err
    assert (f"{what}: the process was busy in compiled code (compiling, loading, or waiting for memory) "
            f"and did not reach its handler within 2 s; stopping now (exit code {code})") in err
    assert "the handler ran" not in err


# A signal taken by a thread other than the main one (the kernel may hand a signal sent to the process to
# any thread that does not block it; here that thread sends it to itself, to be sure), while the main
# thread sleeps in a wait that the signal would have cut short had the main thread taken it.
TAKEN_BY_ANOTHER_THREAD = (
    "import signal, sys, threading, time\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (see the test above)\n"
    "{imports}"
    "def another_thread():\n"
    "    time.sleep(0.5)  # the main thread is in its wait by then\n"
    "    signal.pthread_kill(threading.get_ident(), {signum})\n"
    "start = time.monotonic()\n"
    "{wait}")
WAITS = {"time.sleep": "time.sleep(60)\n", "Event.wait": "threading.Event().wait(60)\n"}


@pytest.mark.parametrize("wait", sorted(WAITS))
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_another_thread_took_still_raises_at_once_in_the_waiting_main_thread(wait, signum):
    """A CI run saw SIGTERM sent to train.py while its main thread slept (held by a test): the kernel gave
    it to one of XLA's threads, Python's handler waited for the main thread's sleep to end, and the
    watcher ended the process 10 s later with 'busy in compiled code'. The watcher now wakes the main
    thread (cli_signals.NUDGE_SIGNAL), whose wait is cut short by the pending handler's exception."""
    script = TAKEN_BY_ANOTHER_THREAD.format(
        imports="from tessera.tools.cli_signals import sigterm_raises\nclass Stop(BaseException): pass\n",
        signum=int(signum),
        wait="with sigterm_raises(Stop, grace=30):\n"
             "    threading.Thread(target=another_thread, daemon=True).start()\n"
             "    try:\n"
             + textwrap.indent(WAITS[wait], " " * 8) +
             "    except (Stop, KeyboardInterrupt) as e:\n"
             "        print(f'{type(e).__name__} raised after {time.monotonic() - start:.1f} s', file=sys.stderr)\n"
             "        sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert proc.returncode == 3, proc.stderr  # without the nudge: 143 or 130 after the 30 s grace
    raised = re.search(r"(\w+) raised after ([\d.]+) s", proc.stderr)
    assert raised[1] == ("Stop" if signum == signal.SIGTERM else "KeyboardInterrupt"), proc.stderr
    assert float(raised[2]) < 10, proc.stderr  # 0.5 s and the start of a thread


def test_a_second_ctrl_c_another_thread_took_stops_the_training_loop_at_once():
    """The training loop's own handlers (StopSignal, inside sigterm_raises in train.py): its first Ctrl-C
    asks for a stop after the step, its second stops at once, as when the loop waits for a save in
    flight. Taken by another thread while the main thread waited, neither ran until the wait ended."""
    script = TAKEN_BY_ANOTHER_THREAD.format(
        imports="from tessera.stop_signals import StopSignal\nfrom tessera.tools.cli_signals import sigterm_raises\n"
                "class Stop(BaseException): pass\n",
        signum=int(signal.SIGINT),
        wait="with sigterm_raises(Stop, grace=30), StopSignal() as stop:\n"
             "    def twice():\n"
             "        another_thread()\n"
             "        while stop.signum is None: time.sleep(0.05)  # the first one's handler ran\n"
             "        print(f'first handled after {time.monotonic() - start:.1f} s', file=sys.stderr, flush=True)\n"
             "        signal.pthread_kill(threading.get_ident(), signal.SIGINT)\n"
             "    threading.Thread(target=twice, daemon=True).start()\n"
             "    threading.Event().wait(60)  # as for a save in flight\n"
             "print('the wait ended by itself', file=sys.stderr)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    took = time.monotonic() - start
    assert proc.returncode == 130, proc.stderr
    first = re.search(r"first handled after ([\d.]+) s", proc.stderr)
    assert first and float(first[1]) < 10, proc.stderr
    assert "SIGINT received again: stopping now" in proc.stderr and "ended by itself" not in proc.stderr
    assert took < 40, proc.stderr  # the 60 s wait was cut short, not waited out (nor the 30 s grace)


def test_a_folder_whose_path_holds_an_equals_sign_is_not_an_override():
    """convert and check_logits took every argument with '=' for key=value: a checkpoint under
    runs/lr=3e-4/ was read as an override and the command stopped with a usage error."""
    from tessera.tools.cli import split_overrides

    args = ["hf-to-tessera", "/data/runs/lr=3e-4/hf", "./out=1", "model_name=llama2-7b", "--weight_dtype=bfloat16"]
    assert split_overrides(args) == (["hf-to-tessera", "/data/runs/lr=3e-4/hf", "./out=1"],
                                     ["model_name=llama2-7b", "--weight_dtype=bfloat16"])


@pytest.mark.parametrize("args", [["-m", "tessera.tools.estimate", "llama3.1-8b", "--hardware", "v5e-8"],
                                  ["-m", "tessera.tools.plan", "default", "--hardware", "v5e-8", "--top", "1"],
                                  ["-m", "tessera.config", "configs/base.yml"],
                                  ["-m", "tessera.tools.validate", "configs/cpu/validate_tiny.json", "--gpu", "cpu",
                                   "--dry-run"]])
def test_a_report_piped_into_a_reader_that_went_away_ends_quietly(args):
    """`estimate ... | head`: the reader closed the pipe, and Python printed a BrokenPipeError traceback (exit 1);
    now the rest of the report is dropped and the code is 141 (128 + SIGPIPE), as for a C tool."""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    proc.stdout.close()  # the reader is gone before the first line: every write meets a closed pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device whose every write fails")
def test_a_report_written_to_a_full_disk_ends_in_one_line_not_a_traceback():
    """`python -m tessera.config > configs/base.yml` on a full disk printed an OSError traceback (exit 1)
    and left the file cut short without saying so; now one line names the failure."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "tessera.config", "configs/base.yml"], cwd=REPO, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr == ("error: the output could not be written (No space left on device); what was written of it "
                           "is incomplete: free space (or choose another file) and run the command again\n")
