"""Host time to build splash attention's mask tables, JAX's masks against Tessera's block-bounds masks.

    .venv/bin/python benchmarks/splash_mask_tables.py [--out benchmarks/results/splash_mask_tables.json]

Splash attention (tessera.models.splash) builds three tables per kernel (forward, dQ, dK/dV:
which query x key blocks it visits and where each one's next data is) on the host, when the step
is traced. JAX's masks compute every block element by element, so the time grows with the
square of the length; Tessera's (`splash._Causal`, `splash._Local`) answer a wholly visible or
hidden block from its bounds and compute only the blocks a diagonal or window edge crosses. The
tables are the same (tests/test_attention_kernels.py checks it).

Workload (fixed): MaxText's `sequence_parallelism` layout, the queries split 16 ways over the
sequence axis and load-balanced, blocks of 512 (the defaults); a causal mask, and a sliding window
of 4,096 (Mistral's size). Lengths 16,384 to 65,536 run both and report the ratio (JAX's time /
Tessera's, in one run); 131,072 to 1,048,576 run Tessera's only (JAX's would take from minutes to
hours). Each figure is one build of the three tables with the cache cleared, on one CPU core.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from bench_cli import checked_out, run_main, write_results

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

SHARDS, BLOCK, WINDOW = 16, 512, 4096
BOTH = (16384, 32768, 65536)
OURS_ONLY = (131072, 262144, 1048576)


def build_seconds(length: int, window: int, ours: bool) -> float:
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info

    from tessera.models import splash

    blocks = sa.BlockSizes(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK, block_q_dkv=BLOCK,
                           block_kv_dkv=BLOCK, block_kv_dkv_compute=BLOCK, block_q_dq=BLOCK, block_kv_dq=BLOCK)
    causal, local = (splash._Causal, splash._Local) if ours else (sa.CausalMask, sa.LocalMask)
    saved = splash._Causal, splash._Local
    splash._Causal, splash._Local = causal, local  # the kernel builder's mask classes for this measurement
    try:
        mask_info._process_mask.cache_clear()
        start = time.perf_counter()
        splash._kernel(1, length, window, 0.0, blocks, True, SHARDS, True)
        return time.perf_counter() - start
    finally:
        splash._Causal, splash._Local = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "splash_mask_tables.json"))
    args = parser.parse_args()
    results_file = checked_out(parser, args.out)  # refused now, not after the run
    import jax

    jax.config.update("jax_platforms", "cpu")
    rows = []
    print(f"{'mask':<8} {'tokens':>10} {'JAX s':>9} {'Tessera s':>10} {'ratio':>8}")
    for name, window in (("causal", 0), ("window", WINDOW)):
        for length in (*BOTH, *OURS_ONLY):
            ours = build_seconds(length, window, ours=True)
            theirs = build_seconds(length, window, ours=False) if length in BOTH else None
            ratio = theirs / ours if theirs else None
            rows.append(dict(mask=name, tokens=length, jax_seconds=theirs, tessera_seconds=ours, ratio=ratio))
            print(f"{name:<8} {length:>10,} {theirs if theirs else float('nan'):>9.2f} {ours:>10.2f} "
                  f"{f'{ratio:.1f}x' if ratio else '-':>8}", flush=True)
    result = dict(benchmark="splash_mask_tables", shards=SHARDS, block=BLOCK, window=WINDOW, load_balanced=True,
                  date=time.strftime("%Y-%m-%d"), host=platform.node(), jax=jax.__version__, rows=rows)
    write_results(results_file, result)
    print(f"wrote {results_file}")


if __name__ == "__main__":
    sys.exit(run_main(main))
