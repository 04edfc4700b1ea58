"""The values derived from (config, mesh shape) in one place: `tessera.config.derived.plan_run`."""

from pathlib import Path

import pytest

from tessera.config import ConfigError, build_config
from tessera.config.derived import plan_run

MESH_8 = {"data": 2, "stage": 1, "fsdp": 4, "sequence": 1, "tensor": 1, "expert": 1}


def test_plan_derives_batch_tokens_schedule_and_paths(tmp_path):
    cfg = build_config({"per_device_batch_size": 1.5, "gradient_accumulation_steps": 3, "max_target_length": 7,
                        "steps": 11, "base_output_directory": str(tmp_path), "run_name": "r"})
    plan = plan_run(cfg, {**MESH_8, "data": 1, "fsdp": 2, "tensor": 4})
    assert (plan.num_devices, plan.global_batch, plan.micro_batches) == (8, 12, 3)
    assert plan.tokens_per_step == 12 * 7 and plan.max_target_length == 7 and plan.schedule_steps == 11
    assert plan.run_dir == tmp_path / "r" and plan.metrics_path == tmp_path / "r" / "metrics.jsonl"
    assert plan.checkpoint_dir == f"{tmp_path}/r/checkpoints"
    assert not plan.dropout_on and not plan.packed  # defaults: dropout off, synthetic data is never packed


def test_plan_takes_the_keys_that_override_derived_values(tmp_path):
    cfg = build_config({"learning_rate_schedule_steps": 40, "metrics_file": str(tmp_path / "m.jsonl"),
                        "checkpoint_dir": "gs://b/ckpt", "enable_dropout": True, "dropout_rate": 0.1,
                        "dataset_type": "hf", "per_device_batch_size": 1})
    plan = plan_run(cfg, MESH_8)
    assert plan.schedule_steps == 40 and plan.metrics_path == Path(tmp_path / "m.jsonl")
    assert plan.checkpoint_dir == "gs://b/ckpt" and plan.dropout_on and plan.packed
    off = plan_run(build_config({"enable_dropout": True, "dropout_rate": 0.0, "per_device_batch_size": 1}), MESH_8)
    assert not off.dropout_on


def test_dropout_rate_alone_turns_dropout_on_as_in_maxtext():
    """MaxText's enable_dropout is true by default, so its users set only dropout_rate; before, Tessera's
    default was false and dropout_rate=0.1 trained without dropout, silently."""
    assert plan_run(build_config({"dropout_rate": 0.1, "per_device_batch_size": 1}), MESH_8).dropout_on
    assert not plan_run(build_config({"dropout_rate": 0.1, "enable_dropout": False, "per_device_batch_size": 1}),
                        MESH_8).dropout_on
    for rate in (1.0, 1.5):  # refused whether dropout is on or not: the value is wrong either way
        for on in (True, False):
            with pytest.raises(ConfigError, match=rf"dropout_rate={rate} must be in \[0, 1\)"):
                build_config({"dropout_rate": rate, "enable_dropout": on})


@pytest.mark.parametrize("keys, message", [
    ({"per_device_batch_size": 0.3}, r"per_device_batch_size=0.3 x 8 devices = 2.4 sequences; .* whole number >= 1"),
    ({"per_device_batch_size": 1, "gradient_accumulation_steps": 2},
     r"global batch 8 / gradient_accumulation_steps=2 must be a whole number divisible by data\*fsdp\*expert=8 "
     r"\(mesh \{'data': 2, 'stage': 1, 'fsdp': 4"),
    ({"eval_interval": 1, "eval_steps": 1, "eval_per_device_batch_size": 0.3},
     r"eval_per_device_batch_size=0.3 x 8 devices = 2.4 sequences; .* whole number >= 1"),
    ({"eval_interval": 1, "eval_steps": 1, "eval_per_device_batch_size": 0.5},
     r"the evaluation batch 4 must be divisible by data\*fsdp\*expert=8 \(mesh .*\); change "
     r"eval_per_device_batch_size or the mesh"),
    # 1e30 ended in a TypeError inside JAX's lowering; 1e12 in a 4.9-billion-GiB memory estimate
    ({"per_device_batch_size": 1e30}, r"a global batch of 8,000,000,000,000,000,[\d,]+ sequences of 128 tokens is .* more "
                                      r"than the 2,147,483,647 that 32-bit token indices reach .*; lower "
                                      r"per_device_batch_size$"),
    ({"per_device_batch_size": 1e308},
     r"per_device_batch_size=1e\+308 x 8 devices = inf sequences, more than the 2,147,483,647 tokens that 32-bit "
     r"token indices reach; lower per_device_batch_size$"),
    ({"eval_interval": 1, "eval_steps": 1, "eval_per_device_batch_size": 1e308},
     r"eval_per_device_batch_size=1e\+308 x 8 devices = inf sequences, .*; lower eval_per_device_batch_size$"),
    ({"per_device_batch_size": 2**21, "max_target_length": 128}, r"a global batch of 16,777,216 sequences of 128 tokens "
                                                                 r"is 2,147,483,648 tokens"),
    ({"eval_interval": 1, "eval_steps": 1, "eval_per_device_batch_size": 2**21},
     r"an evaluation batch of 16,777,216 sequences .*; lower eval_per_device_batch_size$"),
    # one sequence past the limit by itself: the fix is the length (it said "lower per_device_batch_size")
    ({"max_target_length": 99999999999999}, r"a global batch of 64 sequences of 99,999,999,999,999 tokens is .*; lower "
                                             r"max_target_length$"),
])
def test_plan_errors_quote_the_numbers(keys, message):
    with pytest.raises(ConfigError, match=message):
        plan_run(build_config(keys), MESH_8)


def test_the_eval_batch_is_per_device_batch_size_unless_eval_per_device_batch_size_says_otherwise():
    evaluating = {"eval_interval": 5, "eval_steps": 2, "per_device_batch_size": 2, "gradient_accumulation_steps": 2}
    assert plan_run(build_config({**evaluating, "eval_interval": 0}), MESH_8).eval_batch == 0  # no evaluation
    assert plan_run(build_config(evaluating), MESH_8).eval_batch == 16  # the whole train batch, one forward pass
    assert plan_run(build_config({**evaluating, "eval_per_device_batch_size": 3}), MESH_8).eval_batch == 24


def test_num_vocab_tiling_that_does_not_divide_the_eval_batch_is_refused_before_compiling():
    """The eval batch's tokens are cut into num_vocab_tiling chunks too: a smaller
    eval_per_device_batch_size that num_vocab_tiling does not divide stopped the run after the
    train step had compiled, saying only 'change num_vocab_tiling'."""
    one = dict.fromkeys(MESH_8, 1)
    keys = {"per_device_batch_size": 2, "max_target_length": 16, "num_vocab_tiling": 32, "eval_interval": 2,
            "eval_steps": 1}
    assert plan_run(build_config(keys), one).eval_batch == 2  # 2 x 16 tokens: 32 divides them
    with pytest.raises(ConfigError) as e:
        plan_run(build_config({**keys, "eval_per_device_batch_size": 1}), one)
    assert str(e.value) == ("num_vocab_tiling=32 must divide the tokens of an evaluation batch: 1 sequences "
                            "(eval_per_device_batch_size=1 per device) x max_target_length=16 = 16; change "
                            "eval_per_device_batch_size or num_vocab_tiling")
    plan_run(build_config({**keys, "eval_per_device_batch_size": 1, "eval_interval": 0}), one)  # no evaluation


def test_a_gpt3_training_sequence_longer_than_its_position_table_is_refused():
    """Positions past gpt3's learned table were gathered as NaN: the loss was NaN at step 1, with advice
    about the learning rate. Decoding checks its own lengths, so the config itself still loads."""
    gpt3 = {"decoder_block": "gpt3", "mlp_activations": ["gelu"], "trainable_position_size": 64,
            "per_device_batch_size": 1}
    with pytest.raises(ConfigError) as e:
        plan_run(build_config({**gpt3, "max_target_length": 128}), MESH_8)
    assert str(e.value) == ("max_target_length=128 is longer than gpt3's learned position table "
                            "(trainable_position_size=64 rows): positions from 64 on would have no embedding and the "
                            "loss would be NaN; raise trainable_position_size (MaxText's gpt3-175b: 16384) or shorten "
                            "max_target_length")
    plan_run(build_config({**gpt3, "max_target_length": 64}), MESH_8)
    plan_run(build_config({**gpt3, "trainable_position_size": 0, "max_target_length": 4096}), MESH_8)
    plan_run(build_config({"trainable_position_size": 64, "max_target_length": 128, "per_device_batch_size": 1}),
             MESH_8)  # llama2 has no position table: the key is not read
