"""How long a training step is held up by a checkpoint save, async vs sync.

Workload (fixed): Llama block, emb 1024, 6 layers, 16 heads of 64, mlp 2816, vocab 32000,
float32 weights with AdamW state (about 1.7 GiB of train state), batch 1 x 64 tokens, one CPU
device. For each mode the script trains 3 steps, saves, trains 3 more, and records:
`save_call_seconds` (how long `save` blocks the loop), `step_after_save_seconds` (the next
step, which competes with the background write when async), `median_step_seconds` (steps
without a save), and `write_seconds` (from the save call until the checkpoint is complete on
disk: the save call itself when sync; when async, the end of the background write, polled beside
the steps). Each mode runs
without and with `checkpoint_checksums` (a CRC32C of every file, recorded at the save); with them,
`verify_seconds` is how long checking the saved files takes before a restore, and the JSON holds
each mode's write time with checksums over the time without (`write_ratio_checksums_over_none`),
measured without, with, with, without (the means of each pair).

    .venv/bin/python benchmarks/checkpoint_blocking.py [--out benchmarks/results/checkpoint_blocking.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_cli import checked_out, run_main, write_results

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

WORKLOAD = dict(base_emb_dim=1024, base_num_decoder_layers=6, base_num_query_heads=16, base_num_kv_heads=16,
                head_dim=64, base_mlp_dim=2816, vocab_size=32000, max_target_length=64, per_device_batch_size=1,
                remat_policy="none", scan_layers=True)


def time_background_write(ckpt, start: float):
    """A function returning the seconds from `start` until the background save ended, seen by a
    thread polling every 10 ms beside the steps (the steps' own `wait` comes only after them, and
    timing up to it counted the steps too)."""
    ended: list[float] = []

    def poll() -> None:
        while ckpt.manager.is_saving_in_progress():
            time.sleep(0.01)
        ended.append(time.perf_counter() - start)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()

    def seconds() -> float:
        thread.join()
        return ended[0]

    return seconds


def measure(async_save: bool, checksums: bool, out_dir: str) -> dict:
    import jax

    from tessera.checkpointing import Checkpointer
    from tessera.config import build_config
    from tessera.data import make_input, place_batch
    from tessera.step import compile_step, create_state, setup

    cfg = build_config({**WORKLOAD, "async_checkpointing": async_save, "checkpoint_checksums": checksums})
    trainer = setup(cfg, jax.devices()[:1])
    state = create_state(trainer, 0)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    step_fn, _ = compile_step(trainer, 0)
    data = make_input(cfg.data, cfg.model.vocab_size, trainer.plan.global_batch)
    ckpt = Checkpointer(cfg.checkpoint, out_dir)

    def step():
        nonlocal state
        start = time.perf_counter()
        state, stats = step_fn(state, place_batch(data, next(data), trainer.batch_sharding, trainer.plan.global_batch))
        jax.block_until_ready(stats)
        return time.perf_counter() - start

    plain = [step() for _ in range(3)]
    start = time.perf_counter()
    ckpt.save(3, state, data.get_state(), {})
    save_call = time.perf_counter() - start
    # sync: on disk when save returns; async: when the background write ends, beside the next steps
    written = time_background_write(ckpt, start) if async_save else lambda: save_call
    after = step()
    plain += [step() for _ in range(2)]
    ckpt.wait()
    write = written()
    start = time.perf_counter()
    ckpt.verify(3)
    verify = time.perf_counter() - start
    ckpt.close()
    return {"async_checkpointing": async_save, "checkpoint_checksums": checksums, "state_gib": state_bytes / 2**30,
            "save_call_seconds": save_call, "step_after_save_seconds": after,
            "median_step_seconds": statistics.median(plain[1:]), "write_seconds": write,
            "verify_seconds": verify if checksums else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "checkpoint_blocking.json"))
    args = parser.parse_args()
    results_file = checked_out(parser, args.out)  # refused now, not after the run
    rows = []
    for async_save in (False, True):
        for checksums in (False, True, True, False):  # ABBA: a drift (the disk warming up) cancels out
            with tempfile.TemporaryDirectory() as d:
                rows.append(measure(async_save, checksums, d))

    def mean(key: str, async_save: bool, checksums: bool) -> float:
        return statistics.mean(r[key] for r in rows
                               if r["async_checkpointing"] == async_save and r["checkpoint_checksums"] == checksums)

    result = {
        "benchmark": "checkpoint_blocking", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "workload": WORKLOAD,
        "rows": rows,
        "blocking_ratio_async_over_sync":
            mean("save_call_seconds", True, False) / mean("save_call_seconds", False, False),
        "write_ratio_checksums_over_none": {
            mode: mean("write_seconds", a, True) / mean("write_seconds", a, False)
            for mode, a in (("sync", False), ("async", True))},
        "save_call_ratio_checksums_over_none": {
            mode: mean("save_call_seconds", a, True) / mean("save_call_seconds", a, False)
            for mode, a in (("sync", False), ("async", True))},
    }
    write_results(results_file, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(run_main(main))
