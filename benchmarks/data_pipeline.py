"""Input pipeline throughput (tokens/s per host) next to the trainer's tokens/s, as JSON.

Workload (fixed): the default config (`configs/base.yml`: global batch 8 x 129 tokens on one
CPU device, tiny Llama, vocab 512). Data: the first-run corpus (docstrings of this Python's
standard library, `tessera.data.first_run_corpus`) and its 512-token SentencePiece tokenizer,
written as JSONL for `hf`, as ArrayRecord for `grain` and as a TFDS dataset (ArrayRecord
format) for `tfds`. For each dataset_type (synthetic, hf, tfds, grain) and packing on/off the script builds the pipeline, takes `WARMUP_BATCHES` batches,
then times `BATCHES` more; the trainer is timed by running `tessera.train.run` on synthetic
data for `TRAIN_STEPS` steps (median after warm-up). `pipeline_over_trainer` is how many times
faster the pipeline produces batches than the trainer consumes them (batches per second x the
trainer's median seconds per step: a batch with padding is a step all the same): above 1 it is
never the bottleneck (the pipeline runs in the same thread as the step today).

    .venv/bin/python benchmarks/data_pipeline.py [--out benchmarks/results/data_pipeline.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from bench_cli import checked_out, run_main, write_results

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

WARMUP_BATCHES, BATCHES, TRAIN_STEPS = 5, 60, 12


def write_arrayrecord(jsonl: Path, out: Path) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(out), "group_size:1")
    for line in jsonl.open():
        writer.write(json.loads(line)["text"].encode())
    writer.close()


def write_tfds(jsonl: Path, data_dir: Path) -> str:
    """The corpus as a prepared TFDS dataset; returns its dataset_name."""
    import tensorflow_datasets as tfds

    texts = [json.loads(line)["text"] for line in jsonl.open()]

    class TesseraFirstRun(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            return {"train": ((i, {"text": t}) for i, t in enumerate(texts))}

        def _generate_examples(self):  # the split generator above yields the examples
            raise NotImplementedError

    TesseraFirstRun(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return "tessera_first_run:1.0.0"


def pipeline_rate(overrides: dict, base: dict) -> dict:
    from tessera.config import build_config
    from tessera.data import make_input

    cfg = build_config({**base, **overrides})
    global_batch = int(cfg.data.per_device_batch_size)
    start = time.perf_counter()
    data = make_input(cfg.data, cfg.model.vocab_size, global_batch)
    setup_seconds = time.perf_counter() - start
    for _ in range(WARMUP_BATCHES):
        next(data)
    tokens, start = 0, time.perf_counter()
    for _ in range(BATCHES):
        batch = next(data)
        tokens += int((batch["segment_ids"] != 0).sum())
    seconds = time.perf_counter() - start
    return {"tokens_per_sec_per_host": tokens / seconds, "batches_per_sec": BATCHES / seconds,
            "non_padding_fraction": tokens / (BATCHES * batch["tokens"].size), "setup_seconds": setup_seconds}


def trainer_rate(base: dict, out: str) -> dict:
    """The trainer's run report on synthetic data: its tokens/s per device and median seconds per step."""
    from tessera.config import build_config
    from tessera.train import run

    cfg = build_config({**base, "steps": TRAIN_STEPS, "report_warmup_steps": 2, "enable_checkpointing": False,
                        "enable_tensorboard": False, "base_output_directory": out, "run_name": "trainer"})
    import jax

    return run(cfg, jax.devices()[:1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "data_pipeline.json"))
    args = parser.parse_args()
    results_file = checked_out(parser, args.out)  # refused now, not after the run
    from tessera.config import load_config
    from tessera.config.loader import flat_dict
    from tessera.data.first_run_corpus import main as build_first_run

    base = flat_dict(load_config([str(REPO / "configs" / "base.yml")], env={}))
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        build_first_run(["--out", str(corpus)])
        write_arrayrecord(corpus / "train.jsonl", corpus / "train.array_record")
        tfds_name = write_tfds(corpus / "train.jsonl", corpus / "tfds")
        sources = {
            "synthetic": {"dataset_type": "synthetic"},
            "hf": {"dataset_type": "hf", "hf_path": "json", "hf_train_files": str(corpus / "train.jsonl"),
                   "tokenizer_path": str(corpus / "tokenizer.model")},
            "tfds": {"dataset_type": "tfds", "dataset_name": tfds_name, "dataset_path": str(corpus / "tfds"),
                     "tokenizer_path": str(corpus / "tokenizer.model")},
            "grain": {"dataset_type": "grain", "grain_train_files": str(corpus / "train.array_record"),
                      "tokenizer_path": str(corpus / "tokenizer.model")},
        }
        results = {}
        for name, overrides in sources.items():
            for packing in (True, False):
                results[f"{name}/packing={str(packing).lower()}"] = pipeline_rate({**overrides, "packing": packing},
                                                                                   base)
        trainer = trainer_rate(base, tmp)
    for r in results.values():  # in batches: the trainer's tokens/s counts all 128 of a row, the pipeline's none of
        r["pipeline_over_trainer"] = r["batches_per_sec"] * trainer["step_seconds"]  # its padding, of 129
    report = {"machine": f"{os.cpu_count()}-core {platform.machine()}", "python": platform.python_version(),
              "global_batch": int(base["per_device_batch_size"]), "sequence_tokens": base["max_target_length"] + 1,
              "trainer_tokens_per_sec": trainer["tokens_per_sec_per_device"],
              "trainer_step_seconds": trainer["step_seconds"], "pipelines": results,
              "pipeline_is_never_the_bottleneck": all(r["pipeline_over_trainer"] > 1 for r in results.values())}
    write_results(results_file, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(run_main(main))
