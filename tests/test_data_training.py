"""Data through the model and the trainer: packing isolation, hf runs with eval, resume, eval logging."""

import json

import jax
import numpy as np
import optax
import pytest

from conftest import tiny_config
from tessera.config import ConfigError
from tessera.models import build_model
from tessera.losses import loss_sums
from tessera.train import run
from test_checkpointing import _train
from test_data_hf import hf_config, make_docs, write_corpus


def _row(docs, length):
    """One packed row [1, length] of `docs` (lists of ids), each its own segment, then padding."""
    tokens, segments, positions = (np.zeros((1, length), np.int32) for _ in range(3))
    at = 0
    for s, doc in enumerate(docs, start=1):
        tokens[0, at:at + len(doc)], segments[0, at:at + len(doc)] = doc, s
        positions[0, at:at + len(doc)] = np.arange(len(doc))
        at += len(doc)
    return {"tokens": tokens, "segment_ids": segments, "positions": positions}


def _token_losses(model, params, batch):
    def losses(params, batch):
        logits = model.apply(params, batch["tokens"][:, :-1], batch["positions"][:, :-1],
                             batch["segment_ids"][:, :-1], None, packed=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])[0]

    return np.asarray(jax.jit(losses)(params, batch))


def test_a_tokens_loss_ignores_an_unrelated_document_packed_next_to_it():
    cfg = tiny_config(attention="dot_product").model
    model = build_model(cfg)
    params = model.init(jax.random.key(3))
    rng = np.random.default_rng(0)
    doc, other = rng.integers(0, 96, size=7), rng.integers(0, 96, size=9)
    alone = _token_losses(model, params, _row([doc], 17))
    after_other = _token_losses(model, params, _row([other, doc], 17))
    # the document's 6 next-token losses, wherever it sits in the row
    np.testing.assert_allclose(after_other[9:15], alone[:6], rtol=1e-5, atol=1e-6)
    # and the masked sum over the packed row is the sum over the documents on their own
    sums = jax.jit(lambda p, b: loss_sums(model, p, b, None, True))
    total, count = sums(params, _row([other, doc], 17))
    separate = [sums(params, _row([d], 17)) for d in (other, doc)]
    assert float(count) == 8 + 6 == sum(float(n) for _, n in separate)
    np.testing.assert_allclose(float(total), sum(float(s) for s, _ in separate), rtol=1e-5)
    # without segment ids the other document does leak in (so the check above can fail)
    leaky = _row([other, doc], 17)
    leaky["segment_ids"] = np.where(leaky["segment_ids"] > 0, 1, 0).astype(np.int32)
    assert not np.allclose(_token_losses(model, params, leaky)[9:15], alone[:6], rtol=1e-3)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def hf_run_setup(tmp_path_factory):
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("hfrun")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(make_docs(400, seed=9)), model_prefix=str(root / "tok"),
                                   vocab_size=80, model_type="bpe", minloglevel=2)
    train = write_corpus(root / "train", make_docs(60, seed=1), "parquet", files=3)
    evals = write_corpus(root / "eval", make_docs(10, seed=2), "parquet", files=1)
    return root, str(root / "tok.model"), train, evals[1]


def _hf_run(out, setup, steps, **overrides):
    _, tok, train, evals = setup
    # the schedule's length is fixed so a 2-step run is the first half of the 4-step one
    keys = dict(learning_rate_schedule_steps=4, hf_eval_files=evals, eval_interval=2, eval_steps=-1,
                checkpoint_period=2, enable_checkpointing=True, async_checkpointing=False,
                base_output_directory=str(out), run_name="test")
    cfg = hf_config(train, tok, steps=steps, **{**keys, **overrides})
    return run(cfg)


@pytest.mark.slow
def test_hf_training_with_eval_resumes_like_an_uninterrupted_run(tmp_path, hf_run_setup):
    mesh = dict(ici_data_parallelism=2, ici_fsdp_parallelism=4)
    straight = _hf_run(tmp_path / "straight", hf_run_setup, 4, **mesh)
    _hf_run(tmp_path / "resumed", hf_run_setup, 2, **mesh)
    resumed = _hf_run(tmp_path / "resumed", hf_run_setup, 4, **mesh)
    assert resumed["start_step"] == 2
    a, b = _metrics(tmp_path / "straight" / "test"), _metrics(tmp_path / "resumed" / "test")
    train_a = [r["loss"] for r in a if "loss" in r]
    train_b = [r["loss"] for r in b if "loss" in r]
    assert len(train_a) == 4 and train_b == train_a, "the resumed run saw other batches (or other weights)"
    evals = [r for r in a if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["eval_batches"] >= 1 and r["eval_tokens"] > 0 for r in evals)
    assert all(abs(r["eval_perplexity"] - np.exp(r["eval_loss"])) < 1e-6 * r["eval_perplexity"] for r in evals)
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert straight["final_eval_loss"] == evals[1]["eval_loss"]


@pytest.mark.slow
def test_the_eval_batch_size_changes_the_batches_not_the_result(tmp_path, hf_run_setup, caplog):
    """The whole eval set (eval_steps=-1) scored in batches of eval_per_device_batch_size=3 (24
    sequences on 8 devices, the last batch padded) gives the loss and token count of the default
    batches (per_device_batch_size), in fewer batches. eval_steps beyond the data scores the whole
    set too, and says so once."""
    def evals(name, **keys):
        _hf_run(tmp_path / name, hf_run_setup, 2, **keys)
        return [r for r in _metrics(tmp_path / name / "test") if "eval_loss" in r]

    with caplog.at_level("INFO", logger="tessera"):
        beyond = evals("beyond", eval_per_device_batch_size=3, eval_steps=1000)
    short = [r.getMessage() for r in caplog.records if "the eval data ended" in r.getMessage()]
    assert short == [f"the eval data ended after {beyond[0]['eval_batches']} batch(es), fewer than eval_steps=1000: "
                     f"every evaluation scores those {beyond[0]['eval_batches']}; set eval_steps=-1 to say so, or "
                     "add eval documents"]
    default, larger = evals("default"), evals("larger", eval_per_device_batch_size=3)
    assert beyond == [{**larger[0], "eval_seconds": beyond[0]["eval_seconds"]}]
    assert [r["step"] for r in default] == [r["step"] for r in larger] == [2]
    assert larger[0]["eval_tokens"] == default[0]["eval_tokens"] > 0
    assert larger[0]["eval_batches"] < default[0]["eval_batches"], (larger, default)
    np.testing.assert_allclose(larger[0]["eval_loss"], default[0]["eval_loss"], rtol=1e-5)


@pytest.mark.slow
def test_an_evaluation_longer_than_the_step_timeout_is_not_a_hang(tmp_path):
    """step_timeout_seconds bounds the wait for one piece of progress, not the length of an
    evaluation: each eval batch tells the hang watchdog, so 400 quick batches (about 7 s here) run
    to the end under a 1.5 s timeout. Before, the watchdog ended such a run with exit 5 ("no
    training step finished"), and with the default 1800 s, any evaluation over 30 minutes. The
    eval step is compiled before the first step, so no compile runs inside the loop either."""
    proc = _train(tmp_path, "steps=1", "eval_interval=1", "eval_steps=400", "step_timeout_seconds=1.5",
                  "enable_checkpointing=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in _metrics(tmp_path / "sub") if "eval_loss" in r]
    assert [(r["step"], r["eval_batches"]) for r in evals] == [(1, 400)] and evals[0]["eval_seconds"] > 1.5
    compiled = proc.stderr.index("eval step compiled in")
    assert compiled < proc.stderr.index("step     1 |") and "hang watchdog" not in proc.stderr


def test_synthetic_eval_goes_to_jsonl_and_tensorboard(tmp_path):
    cfg = tiny_config(tmp_path, steps=2, eval_interval=1, eval_steps=2, enable_tensorboard=True,
                      enable_checkpointing=False)
    run(cfg)
    evals = [r for r in _metrics(tmp_path / "test") if "eval_loss" in r]
    assert [(r["step"], r["eval_batches"]) for r in evals] == [(1, 2), (2, 2)]
    events = b"".join(p.read_bytes() for p in (tmp_path / "test" / "tensorboard").rglob("*tfevents*"))
    assert b"eval/loss" in events and b"eval/perplexity" in events and b"train/loss" in events
    with pytest.raises(ConfigError, match="eval_steps=-1 reads the eval data to its end, but synthetic data"):
        run(tiny_config(tmp_path / "x", eval_interval=1, eval_steps=-1, enable_checkpointing=False))


def test_an_eval_loss_past_the_float_range_has_an_infinite_perplexity(tmp_path):
    """eval_perplexity was exp(min(loss, 700)): 1.01e304 for a loss of 800 and for an infinite one
    alike, a finite number next to eval_loss null. It is inf now (null in metrics.jsonl)."""
    from tessera import metrics
    from tessera.evaluation import Evaluator
    from tessera.step import setup

    cfg = tiny_config(tmp_path, eval_interval=1, eval_steps=2)
    evaluator = Evaluator(cfg.data, setup(cfg, jax.devices()[:1]))
    for loss, expected in ((2.0, np.exp(2.0)), (800.0, np.inf), (np.inf, np.inf)):
        evaluator.step_fn = lambda params, batch, loss=loss: {"loss_sum": np.float32(loss * 12), "count": np.float32(12),
                                                              "rows": np.float32(1)}
        record = evaluator.run(1, None)
        assert record["eval_tokens"] == 24 and record["eval_perplexity"] == pytest.approx(expected), (loss, record)
    assert json.loads(metrics.to_json(record))["eval_perplexity"] is None


def test_a_run_stops_its_input_pipelines_workers(tmp_path, monkeypatch):
    """The trainer stops the training and eval pipelines' workers (grain_worker_count) when the run
    ends: left to the interpreter's exit, a resumed run's Grain workers printed tracebacks after it."""
    import tessera.evaluation
    import tessera.train
    from tessera.data import make_input

    closed = []

    def tracked(cfg, vocab_size, global_batch, split="train", sharding=None):
        data = make_input(cfg, vocab_size, global_batch, split, sharding)
        data.stop_workers = lambda: closed.append(split)
        return data

    monkeypatch.setattr(tessera.train, "make_input", tracked)
    monkeypatch.setattr(tessera.evaluation, "make_input", tracked)
    run(tiny_config(tmp_path, steps=1, eval_interval=1, eval_steps=1, enable_checkpointing=False))
    assert sorted(closed) == ["eval", "train"]


def test_a_batch_the_processes_do_not_divide_names_the_key_that_sets_it(monkeypatch):
    """The pipelines that read only their own rows (hf, grain, tfds) split a batch over the
    processes; a batch they do not divide names its key: the train batch's or the eval batch's."""
    from tessera.data import rows_per_process

    monkeypatch.setattr(jax, "process_count", lambda: 3)
    assert rows_per_process(9) == rows_per_process(9, "eval") == 3
    with pytest.raises(ConfigError, match=r"^the global batch of 8 sequences does not divide across 3 processes; "
                                          r"change per_device_batch_size$"):
        rows_per_process(8)
    with pytest.raises(ConfigError, match=r"^the evaluation batch of 8 sequences does not divide across 3 processes; "
                                          r"change eval_per_device_batch_size$"):
        rows_per_process(8, "eval")


def test_eval_data_without_target_tokens_is_refused_before_the_first_step(tmp_path, hf_run_setup):
    """Documents of one token each (a begin token and empty text) hold no target: the evaluation
    found it out after eval_interval steps of training, and stopped before that step's checkpoint
    was saved (1,000 steps lost with eval_interval=checkpoint_period=1000)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    one_token = tmp_path / "one_token.parquet"
    pq.write_table(pa.table({"text": [""] * 5}), one_token)
    with pytest.raises(ConfigError, match=r"^the eval data holds no target tokens \(every document is shorter than 2 "
                                          r"tokens\?\)"):
        _hf_run(tmp_path, hf_run_setup, 4, hf_eval_files=str(one_token), add_eos=False)
    assert not (tmp_path / "test" / "metrics.jsonl").exists()  # no step trained
