"""The Hugging Face reference interpreter, seen from the main venv.

PyTorch and transformers live in their own interpreter (`bash setup.sh HF_REFERENCE=1` makes
.venv-hf; requirements-hf.txt lists it), so the parity tests and check_logits call
`hf_reference.py` as a subprocess and exchange .npz files. This module imports only the
standard library and numpy: importing it never needs torch.

    python = reference_python()          # None when no reference is installed
    make_tiny("llama3", tmp / "llama3")  # a tiny random HF checkpoint
    logits_btv = reference_logits(tmp / "llama3", input_ids_bt, attention_mask_bt)
    # several in one run of the interpreter (each start costs seconds): make, then run
    [out] = reference_outputs_many([(tmp / "gemma", input_ids_bt)], before=[tiny_command("gemma", tmp / "gemma")])
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().with_name("hf_reference.py")
HF_VENV = ".venv-hf"
ENV_PYTHON = "TESSERA_HF_PYTHON"


class ReferenceUnavailable(RuntimeError):
    """No interpreter with torch and transformers was found."""

    def __init__(self, detail: str = "no Python with torch and transformers was found"):
        super().__init__(
            f"Hugging Face reference unavailable: {detail}. Install it with "
            f"`bash setup.sh HF_REFERENCE=1` (creates {HF_VENV}/ beside setup.sh), or set "
            f"{ENV_PYTHON}=/path/to/python of an interpreter with torch and transformers.")


class ReferenceFailed(RuntimeError):
    """The reference interpreter ran and failed (its last error line says why) or timed out."""


def _repo_roots() -> list[Path]:
    """Folders holding setup.sh: above this file (a source checkout), then the working dir."""
    starts = [SCRIPT.parent, Path.cwd()]
    roots = []
    for start in starts:
        for folder in (start, *start.parents):
            if (folder / "setup.sh").is_file() and folder not in roots:
                roots.append(folder)
                break
    return roots


def reference_python() -> str | None:
    """The interpreter that has torch and transformers, or None.

    Order: $TESSERA_HF_PYTHON (must exist), <repo>/.venv-hf/bin/python, this interpreter if
    it can import both.
    """
    configured = os.environ.get(ENV_PYTHON)
    if configured:
        if not Path(configured).exists():
            raise ReferenceUnavailable(f"{ENV_PYTHON}={configured} does not exist")
        if not Path(configured).is_file() or not os.access(configured, os.X_OK):
            raise ReferenceUnavailable(f"{ENV_PYTHON}={configured} is not an executable file (a Python interpreter)")
        return configured
    for root in _repo_roots():
        python = root / HF_VENV / "bin" / "python"
        if python.exists():
            return str(python)
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        return sys.executable
    return None


def run_reference(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs `hf_reference.py *args` in the reference interpreter; raises with its stderr tail."""
    python = reference_python()
    if python is None:
        raise ReferenceUnavailable()
    cmd = [python, str(SCRIPT), *map(str, args)]
    # The reference interpreter must not see the main venv's paths; it never needs a hub.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise ReferenceFailed(f"Hugging Face reference timed out after {timeout:.0f} s: {' '.join(cmd)}") from e
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        if any(line.startswith("ModuleNotFoundError") for line in lines[-3:]):
            raise ReferenceUnavailable(f"{python} cannot import what the reference needs ({lines[-1]})")
        raise ReferenceFailed(f"the Hugging Face reference failed (exit {proc.returncode}): "
                              f"{lines[-1] if lines else 'no error output'} (command: {' '.join(cmd)})")
    return proc


def tiny_command(family: str, out_dir: str | Path, seed: int = 0, max_shard_size: str | None = None) -> list[str]:
    """The hf_reference.py command that saves a tiny random float32 HF checkpoint of `family`
    (hf_reference.FAMILIES: llama2, llama3, mistral, mixtral, gemma, gemma2, gpt2, qwen2, qwen3, qwen3_moe,
    gemma3, deepseek, deepseek_v2, gpt_oss, llama_bias_yarn, llama4, gemma3_multimodal, olmo3, olmo2) to
    `out_dir`; a small
    `max_shard_size` ("20KB") shards it."""
    command = ["tiny", family, str(out_dir), "--seed", str(seed)]
    return command + ["--max-shard-size", max_shard_size] if max_shard_size else command


def make_tiny(family: str, out_dir: str | Path, seed: int = 0,
              max_shard_size: str | None = None) -> Path:
    """Saves a tiny random checkpoint (see tiny_command) to `out_dir` and returns its path."""
    run_reference(*tiny_command(family, out_dir, seed, max_shard_size))
    return Path(out_dir)


def run_commands(commands: Sequence[Sequence[str]], timeout: float = 600) -> None:
    """Runs several hf_reference.py commands in order in one reference interpreter (its start-up
    and imports cost seconds, more than a tiny model's command)."""
    if len(commands) == 1:
        run_reference(*commands[0], timeout=timeout)
        return
    with tempfile.TemporaryDirectory(prefix="tessera-hf-") as tmp:
        listing = Path(tmp) / "commands.json"
        listing.write_text(json.dumps([[str(a) for a in c] for c in commands]))
        run_reference("batch", str(listing), timeout=timeout)


def reference_outputs_many(requests: Sequence[tuple], before: Sequence[Sequence[str]] = ()) -> list[dict]:
    """`reference_outputs` for each (hf_dir, input_ids[, attention_mask[, position_ids]]) of
    `requests`, in one reference run, after the commands in `before` (e.g. tiny_command's)."""
    with tempfile.TemporaryDirectory(prefix="tessera-hf-") as tmp:
        commands, outputs = [list(c) for c in before], []
        for i, (hf_dir, *arrays) in enumerate(requests):
            inputs = dict(zip(("input_ids", "attention_mask", "position_ids"), arrays))
            in_npz, out_npz = Path(tmp) / f"in{i}.npz", Path(tmp) / f"out{i}.npz"
            np.savez(in_npz, **{k: np.asarray(v, np.int64) for k, v in inputs.items() if v is not None})
            commands.append(["logits", str(hf_dir), str(in_npz), str(out_npz)])
            outputs.append(out_npz)
        run_commands(commands)
        results = []
        for out_npz in outputs:
            with np.load(out_npz) as out:
                results.append({k: out[k] for k in out.files})
        return results


def reference_outputs(hf_dir: str | Path, input_ids, attention_mask=None,
                      position_ids=None) -> dict[str, np.ndarray]:
    """All arrays the reference returns: `logits` [B, T, V] float32, and for MoE models
    `router_logits` [layers, B*T, E]. Inputs are [B, T] integer arrays."""
    return reference_outputs_many([(hf_dir, input_ids, attention_mask, position_ids)])[0]


def reference_logits(hf_dir: str | Path, input_ids, attention_mask=None,
                     position_ids=None) -> np.ndarray:
    """Logits [B, T, V] float32 of the HF checkpoint in `hf_dir` (eager attention, no cache).

    input_ids, attention_mask, position_ids: [B, T]. Without position_ids every row uses
    0..T-1 whatever the padding; logits at padded positions carry no meaning.
    """
    return reference_outputs(hf_dir, input_ids, attention_mask, position_ids)["logits"]
