"""Decoding's memory and work, from programs compiled on this host (no weights are read or made).

Workloads (fixed): bfloat16 compute and weights, the model files in configs/models/, one device.

    mistral-7b prefill   one prompt of 32,768 tokens, 16 new (every layer has a 4,096-token window)
    gemma3-4b prefill    one prompt of 131,072 tokens, 16 new (five of every six layers local, window 1,024)
    llama2-7b prefill    one prompt of 4,096 tokens, 16 new (no window: the baseline family)
    llama2-7b step       one decoding step of 8 prompts over a 4,096-token cache
    deepseek-v3 step     one decoding step of 4 prompts over a 32,768-token cache (multi-head latent attention)

For each: the KV cache `decode.py` creates (`kv_cache_bytes`) and, measured in the same run, the
cache of every position that the same model would need without its windows (sliding_window_size=0,
the layout before ring buffers); then the compiled call's temporaries (XLA's memory analysis: a
prefill holds the prompt's activations and its attention, in query chunks; a step, little beside
the cache it updates in place) and, for steps, XLA's cost analysis (operations and bytes
accessed). The programs are compiled for XLA:CPU, whose buffer assignment differs from a TPU's;
the figures compare layouts and algorithms, not devices.

    .venv/bin/python benchmarks/decode_memory.py [--out benchmarks/results/decode_memory.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench_cli import checked_out, run_main, write_results

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

WORKLOADS = {  # name: (model, call, prompts, tokens of the prompt or of the cache, new tokens)
    "mistral-7b prefill": ("mistral-7b", "prefill", 1, 32768, 16),
    "gemma3-4b prefill": ("gemma3-4b", "prefill", 1, 131072, 16),
    "llama2-7b prefill": ("llama2-7b", "prefill", 1, 4096, 16),
    "llama2-7b step": ("llama2-7b", "step", 8, 4096, 0),
    "deepseek-v3 step": ("deepseek-v3", "step", 4, 32768, 0),
}
GIB = 2**30


def phase(text: str) -> None:
    print(f"[decode_memory {time.strftime('%H:%M:%S')}] {text}", flush=True)


def build(name: str, tokens: int, **overrides):
    from tessera.config import load_config
    from tessera.models import build_model

    keys = {"model_name": name, "run_name": "bench", "dtype": "bfloat16", "weight_dtype": "bfloat16",
            "max_target_length": tokens, **overrides}
    return build_model(load_config([str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in keys.items())],
                                   env={}).model)


def compiled(model, rows: int, width: int, tokens: int, empty: bool):
    """The decoding call for `rows` prompts of `width` tokens into a cache of `tokens` (empty: the prefill)."""
    import jax
    import jax.numpy as jnp

    from tessera.generation import _decode_step
    from tessera.models.kv_cache import KVCache

    cache = jax.eval_shape(lambda: model.init_cache(rows, tokens))
    prompt = jax.ShapeDtypeStruct((rows, width), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    step = jax.jit(functools.partial(_decode_step, model=model, temperature=0.0, top_k=0), donate_argnames="cache")
    return step.lower(model.param_shapes(), prompt, prompt, prompt, KVCache.as_empty(cache) if empty else cache,
                      key).compile()


def measure(name: str, call: str, rows: int, tokens: int, new: int) -> dict:
    from tessera.generation import kv_cache_bytes

    total = tokens + new
    model = build(name, total)
    out = {"call": call, "prompts": rows, "tokens": tokens, "new_tokens": new,
           "kv_cache_gib": kv_cache_bytes(model, rows, total) / GIB,
           "kv_cache_every_position_gib": kv_cache_bytes(build(name, total, sliding_window_size=0), rows, total) / GIB}
    program = compiled(model, rows, tokens if call == "prefill" else 1, total, empty=call == "prefill")
    out["temporaries_gib"] = program.memory_analysis().temp_size_in_bytes / GIB
    if call == "step":
        cost = program.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out.update(gflop=cost.get("flops", 0.0) / 1e9, bytes_accessed_gib=cost.get("bytes accessed", 0.0) / GIB)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "decode_memory.json"))
    args = parser.parse_args()
    results_file = checked_out(parser, args.out)  # refused now, not after the run
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results = {}
    for name, (model, call, rows, tokens, new) in WORKLOADS.items():
        phase(f"{name}: {rows} prompt(s), {tokens} tokens, compiling from shapes")
        results[name] = measure(model, call, rows, tokens, new)
        phase(f"{name}: {results[name]}")
    result = {"benchmark": "decode_memory", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "compute": "bfloat16, XLA:CPU programs",
              "workloads": results}
    write_results(results_file, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(run_main(main))
