"""Compare Tessera's logits with the Hugging Face implementation's on the same tokens.

    .venv/bin/python -m tessera.tools.check_logits <hf_dir> <tessera_checkpoint> model_name=<name> [key=value ...]
        [--tokens 1,2,3,...] [--max-abs-diff 1e-3] [--max-kl 1e-4]

The Hugging Face side runs `transformers` on the CPU in float32, in the reference interpreter
(`bash setup.sh HF_REFERENCE=1`, or TESSERA_HF_PYTHON); the Tessera side restores the
checkpoint's parameters (a training step folder or one written by `tools.convert`) and runs
the model the config describes. Without --tokens, 32 token ids are drawn from the vocabulary
with a fixed seed. One line per position: max |logit difference| and KL(p_hf || p_tessera) in
nats. Exit 0 when both stay under their thresholds at every position, 1 when not, 2 on bad
input (and when the Hugging Face side cannot run: a damaged checkpoint, an interpreter without
torch), 130 on Ctrl-C. Relative paths are read from the working directory.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from tessera.config import Config, ConfigError
from tessera.tools import hf_env
from tessera.tools.cli import UsageError, exit_if_help, help_text, resolve_path, split_overrides, take_options
from tessera.tools.estimate import load_model_config

USAGE = (".venv/bin/python -m tessera.tools.check_logits <hf_dir> <tessera_checkpoint> model_name=<name> [key=value ...] "
         "[--tokens 1,2,3] [--max-abs-diff 1e-3] [--max-kl 1e-4]")
OPTIONS = {"--tokens": "", "--max-abs-diff": "1e-3", "--max-kl": "1e-4"}


def tessera_logits(cfg: Config, checkpoint: str, tokens_bt: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] of the checkpoint's parameters for `tokens_bt`, on one device."""
    import jax

    from tessera.checkpointing import CheckpointError, load_parameters
    from tessera.models import build_model

    model = build_model(cfg.model)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), model.param_shapes())
    try:
        params = load_parameters(checkpoint, abstract, key=None)  # errors name `checkpoint <path>`
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return np.asarray(jax.jit(model.apply)(params, tokens_bt))


def compare(ours_tv: np.ndarray, ref_tv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position: max |difference| and KL(softmax(ref) || softmax(ours)) in nats."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp_ref, lp_ours = log_softmax(ref_tv), log_softmax(ours_tv)
    kl = np.sum(np.exp(lp_ref) * (lp_ref - lp_ours), axis=-1)
    return np.abs(ours_tv.astype(np.float64) - ref_tv).max(axis=-1), kl


def _tokens(text: str, vocab: int) -> np.ndarray:
    if not text:
        return np.random.default_rng(0).integers(0, vocab, size=(1, 32)).astype(np.int32)
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(f"--tokens {text!r} must be comma-separated token ids, e.g. --tokens 1,306,4658") from None
    if not ids or min(ids) < 0 or max(ids) >= vocab:
        raise ConfigError(f"--tokens must be 1 or more ids in [0, {vocab}); got {text!r}")
    return np.asarray([ids], np.int32)


def check_logits_help() -> str:
    return help_text(
        USAGE,
        "Compare Tessera's logits with those of Hugging Face transformers (CPU, float32, the reference\n"
        "environment of `bash setup.sh HF_REFERENCE=1`) on the same tokens. Exit 0 when every position\n"
        "stays under both thresholds, 1 when not, 2 on bad input.",
        options=[("--tokens 1,2,3", "token ids to compare on (default: 32 ids drawn with a fixed seed)"),
                 ("--max-abs-diff X", "largest |logit difference| allowed (default 1e-3)"),
                 ("--max-kl X", "largest KL(p_hf || p_tessera) in nats allowed (default 1e-4)")],
        keys=("model_name", "weight_dtype"), docs=("getting_started/Models.md",))


def run(argv: list[str]) -> int:
    options, args = take_options(argv, OPTIONS)
    max_abs, max_kl = _threshold(options, "--max-abs-diff"), _threshold(options, "--max-kl")
    positional, overrides = split_overrides(args)
    if len(positional) != 2:
        raise UsageError(f"give a Hugging Face folder and a Tessera checkpoint (got {positional})\nusage: {USAGE}")
    hf_dir = Path(resolve_path(positional[0], "Hugging Face folder"))
    checkpoint = resolve_path(positional[1], "checkpoint")
    from tessera.tools.hf_reader import read_hf_config

    hf_config = read_hf_config(hf_dir)
    cfg = load_model_config(None, overrides)
    from tessera.tools.convert import check_same_model

    check_same_model(cfg, hf_config)
    tokens = _tokens(options["--tokens"], cfg.model.vocab_size)
    ref = hf_env.reference_logits(hf_dir, tokens)
    ours = tessera_logits(cfg, checkpoint, tokens)
    diff, kl = compare(ours[0], ref[0])
    print(f"{'pos':>5} {'token':>8} {'max_abs_diff':>14} {'kl_nats':>12}")
    for t, (tok, d, k) in enumerate(zip(tokens[0], diff, kl)):
        print(f"{t:>5} {tok:>8} {d:>14.3e} {k:>12.3e}")
    ok = bool(diff.max() <= max_abs and kl.max() <= max_kl)
    print(f"max abs diff {diff.max():.3e} (threshold {max_abs:g}), max KL {kl.max():.3e} nats "
          f"(threshold {max_kl:g}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _threshold(options: dict[str, str], name: str) -> float:
    try:
        value = float(options[name])
    except ValueError:
        raise UsageError(f"{name} {options[name]!r} is not a number; e.g. {name} {OPTIONS[name]}") from None
    if not (math.isfinite(value) and value >= 0):  # nan or a negative bound fails every position, inf passes all
        raise UsageError(f"{name} {options[name]} must be a finite number >= 0; e.g. {name} {OPTIONS[name]}")
    return value


def main(argv: list[str]) -> int:
    exit_if_help(argv, check_logits_help)
    try:
        return run(argv)
    except (ConfigError, UsageError, hf_env.ReferenceUnavailable, hf_env.ReferenceFailed) as e:
        print(f"error: {e}", file=sys.stderr)  # never exit 1: that says the logits differ
        return 2
    except KeyboardInterrupt:  # it writes nothing, so there is nothing to clean up
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    from tessera.platforms import use_cpu_on_hosts_without_accelerators

    use_cpu_on_hosts_without_accelerators()
    sys.exit(main(sys.argv[1:]))
