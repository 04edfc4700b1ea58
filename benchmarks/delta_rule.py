"""The gated delta rule (qwen3_next's Gated DeltaNet layers) in chunks against token by token, on CPU.

    .venv/bin/python benchmarks/delta_rule.py [--rounds 3] [--out benchmarks/results/delta_rule.json]

Workload (fixed): 2 sequences of 2048 tokens, 8 value heads, key and value heads of 128 (Qwen3-Next's
head sizes), float32, forward and backward (the gradient of a sum of the outputs with respect to
queries, keys, values, decays and steps), one jitted program per variant, on one CPU device. The
variants: `tessera.models.gated_deltanet.chunked_delta_rule` with chunks of 16, 32, 64 (the default
gdn_chunk_size) and 128 tokens, and `recurrent_delta_rule`, the definition, one `lax.scan` step per
token. Each round times every variant once, alternating (the median of 3 calls after a warm-up
call); the result is each variant's median over rounds, and its speed as a ratio against the
token-by-token rule measured in the same run (above 1: faster). The outputs of each chunk size
are checked against the definition before anything is timed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from bench_cli import at_least, checked_out, run_main, write_results

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

WORKLOAD = dict(batch=2, length=2048, heads=8, key_dim=128, value_dim=128, dtype="float32")
CHUNKS = (16, 32, 64, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "delta_rule.json"))
    args = parser.parse_args()
    results_file = checked_out(parser, args.out)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tessera.models.gated_deltanet import chunked_delta_rule, l2_normalized, recurrent_delta_rule

    b, t, h, dk, dv = (WORKLOAD[k] for k in ("batch", "length", "heads", "key_dim", "value_dim"))
    ks = jax.random.split(jax.random.key(0), 5)
    inputs = (l2_normalized(jax.random.normal(ks[0], (b, t, h, dk))), l2_normalized(jax.random.normal(ks[1], (b, t, h, dk))),
              jax.random.normal(ks[2], (b, t, h, dv)), -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h))),
              jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))))
    segments = jnp.ones((b, t), jnp.int32)
    rules = {f"chunked_{c}": (lambda c: lambda *a: chunked_delta_rule(*a, segments, c)[0])(c) for c in CHUNKS}
    rules["token_by_token"] = lambda *a: recurrent_delta_rule(*a, segments)
    reference = jax.jit(rules["token_by_token"])(*inputs)
    for name, rule in rules.items():
        error = float(jnp.abs(jax.jit(rule)(*inputs) - reference).max())
        if error > 1e-4:
            raise SystemExit(f"{name} is {error:.2e} from the token-by-token rule; not timed")
    steps = {name: jax.jit(jax.grad(lambda *a, rule=rule: jnp.sum(rule(*a)), argnums=range(5))) for name, rule in
             rules.items()}

    def timed(step) -> float:
        jax.block_until_ready(step(*inputs))  # warm-up (and, the first time, the compile)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(step(*inputs))
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.rounds):
        for name, step in steps.items():
            seconds[name].append(timed(step))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {1e3 * s[-1]:.0f} ms" for n, s in seconds.items()),
              flush=True)
    median = {name: statistics.median(v) for name, v in seconds.items()}
    base = median["token_by_token"]
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "jax": jax.__version__, "rounds": args.rounds, "workload": WORKLOAD,
        "ms_forward_backward": {n: 1e3 * s for n, s in median.items()},
        "speed_over_token_by_token": {n: base / s for n, s in median.items()},
        "per_round_seconds": seconds, "numpy": np.__version__,
    }
    write_results(results_file, result)
    print("forward + backward: " + ", ".join(f"{n} {1e3 * s:.0f} ms ({base / s:.1f}x)" for n, s in median.items())
          + f" -> {results_file}")


if __name__ == "__main__":
    sys.exit(run_main(main))
