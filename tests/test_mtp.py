"""Multi-token prediction (mtp_num_layers): the loss against a direct computation on shortened
sequences, causality and document boundaries, the main model left as it was, training on one
device and on a sharded mesh, MoE depths (router loss, routed bias), evaluation (the MTP loss and a
depth's acceptance rate), counts and config errors."""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import tiny_config
from test_families import FAMILIES
from tessera.config import ConfigError
from tessera.evaluation import eval_sums
from tessera.metrics import format_eval, format_record, matmul_params
from tessera.models import build_model
from tessera.models.decoder import MTP_LOAD
from tessera.models.mtp import chain_weights
from tessera.losses import loss_terms, mtp_terms, target_weights
from tessera.tools.memory_model import count_params
from tessera.train import run

T = 12  # tiny_config's max_target_length


def _batch(rows=2, seed=0, segments=None):
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 96, (rows, T + 1)), jnp.int32)
    seg = jnp.ones_like(tokens) if segments is None else jnp.asarray(segments, jnp.int32)
    return {"tokens": tokens, "segment_ids": seg, "positions": jnp.broadcast_to(jnp.arange(T + 1), tokens.shape)}


def test_chain_weights_need_every_target_up_to_the_depth_in_the_document():
    # targets' weights for segments [1 1 1 1 2 2 2 0]: position 3's target starts document 2, 6's is padding
    w = jnp.asarray([[1, 1, 1, 0, 1, 1, 0]], bool)
    np.testing.assert_array_equal(chain_weights(w, 0), w)
    np.testing.assert_array_equal(chain_weights(w, 1), [[1, 1, 0, 0, 1, 0, 0]])
    np.testing.assert_array_equal(chain_weights(w, 2), [[1, 0, 0, 0, 0, 0, 0]])


def _depth_states(module, x, tokens) -> list:
    """(k, depth k's hidden state) for depths 1 and 2, computed directly from the main model's hidden states `x` on
    sequences cut to the T - k positions whose chain of k + 1 targets lies inside the sequence (no shifting or
    masking)."""
    states, h = [], x
    for k in (1, 2):
        n = T - k
        positions = jnp.broadcast_to(jnp.arange(n), (tokens.shape[0], n))
        h, _ = getattr(module, f"mtp_{k}")(h[:, :n], module.embed(tokens[:, k:k + n], positions + k), positions,
                                           jnp.ones_like(positions), None, False)
        states.append((k, h))
    return states


@pytest.mark.parametrize("family", ["llama2", "deepseek"])
def test_mtp_loss_equals_a_direct_computation_on_shortened_sequences(family):
    """Depth k on position i sees the tokens up to i + k and predicts token i + k + 1: computed
    directly on sequences cut to T - k tokens (no shifting or masking), the losses agree."""
    cfg = tiny_config(**FAMILIES.get(family, {}), mtp_num_layers=2).model
    model = build_model(cfg)
    params = jax.jit(model.init)(jax.random.key(0))  # each side jitted: one compile, not one per operation
    batch = _batch()
    got = jax.jit(lambda p, b: mtp_terms(model, p, model.hidden_with_aux(p, b["tokens"][:, :-1])[0], b, None))(
        params, batch)

    @jax.jit
    def direct(params, tokens):
        module = model._module(params)
        return jnp.stack([optax.softmax_cross_entropy_with_integer_labels(
            module.logits(h, mtp_depth=k), tokens[:, k + 1:k + 1 + h.shape[1]]).mean()
            for k, h in _depth_states(module, module.hidden(tokens[:, :-1])[0], tokens)])

    np.testing.assert_allclose(got["mtp_loss"], np.mean(direct(params, batch["tokens"])), rtol=1e-5)
    assert np.isfinite(got["mtp_loss"]) and float(got["mtp_loss"]) > 1.0
    if family == "deepseek":  # the depths' routers: their loss and their loads per depth
        assert got[MTP_LOAD].shape == (2, 8) and float(got["mtp_moe_load_balance_loss"]) > 0


def test_a_depth_sees_no_token_past_its_target_and_no_other_document():
    """Changing input token 7 changes depth 1 at positions 6 and on (it embeds token i + 1) and
    depth 2 at 5 and on. Two documents packed in one row give the MTP loss of the same two
    documents each in a row of its own, padded: nothing crosses the boundary, neither attention
    nor a chain of targets."""
    model = build_model(tiny_config(mtp_num_layers=2).model)
    params = jax.jit(model.init)(jax.random.key(1))  # jitted here and below: one compile, not one per operation
    tokens = _batch(rows=1)["tokens"][:, :-1]

    @jax.jit
    def depths(t):
        x = model.hidden_with_aux(params, t)[0]
        return model.mtp_hidden(params, x, t)[0]

    changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % 96)
    for k, (a, b) in enumerate(zip(depths(tokens), depths(changed)), start=1):
        moved = np.abs(np.asarray(a - b)).max(axis=(0, 2))
        assert (moved[:7 - k] == 0).all() and (moved[7 - k:] > 1e-6).all(), (k, moved)

    one = build_model(tiny_config(mtp_num_layers=1).model)  # one depth: its loss is a sum over a count
    params = jax.jit(one.init)(jax.random.key(1))
    ids = np.random.default_rng(7).integers(1, 96, T + 1)
    n = 7  # document 1: ids[:7], document 2: ids[7:]
    packed = {"tokens": jnp.asarray([ids], jnp.int32), "segment_ids": jnp.asarray([[1] * n + [2] * (T + 1 - n)]),
              "positions": jnp.asarray([list(range(n)) + list(range(T + 1 - n))])}
    alone = {"tokens": jnp.asarray([list(ids[:n]) + [0] * (T + 1 - n), list(ids[n:]) + [0] * n], jnp.int32),
             "segment_ids": jnp.asarray([[1] * n + [0] * (T + 1 - n), [1] * (T + 1 - n) + [0] * n]),
             "positions": jnp.asarray([list(range(T + 1))] * 2)}

    @jax.jit
    def mtp_loss(batch):
        x = one.hidden_with_aux(params, batch["tokens"][:, :-1], batch["positions"][:, :-1],
                                batch["segment_ids"][:, :-1], packed=True)[0]
        return mtp_terms(one, params, x, batch, None, packed=True)["mtp_loss"]

    np.testing.assert_allclose(mtp_loss(packed), mtp_loss(alone), rtol=1e-5)
    crossing = {**packed, "segment_ids": jnp.ones_like(packed["segment_ids"])}  # the same ids as one document
    assert abs(float(mtp_loss(crossing)) - float(mtp_loss(packed))) > 1e-3


def test_eval_reports_the_mtp_loss_and_a_depth_s_acceptance_rate():
    """eval_sums against a direct computation on shortened sequences: depth 2's greedy token at
    position i is accepted when it equals the main model's greedy token at i + 2 (both guess
    token i + 3). The output layer is cut to 3 tokens (the others' logits 0), so guesses agree
    often but not always. A row that ends in padding offers only the positions whose chain of
    targets is real. With num_vocab_tiling=4 every sum is the same."""
    def sums(tiles):
        model = build_model(tiny_config(mtp_num_layers=2, mtp_eval_target_module=2, num_vocab_tiling=tiles).model)
        params = jax.jit(model.init)(jax.random.key(4))
        params["logits_dense_dv"] = params["logits_dense_dv"].at[:, 3:].set(0.0)
        return model, params, jax.jit(lambda p, b: eval_sums(model, p, b))(params, batch)

    batch = _batch(rows=4, seed=5)
    batch["segment_ids"] = batch["segment_ids"].at[3, 9:].set(0)  # row 3: tokens 9.. are padding
    model, params, got = sums(1)

    @jax.jit  # one compile, not one per operation
    def greedy(params, tokens):
        """The main model's greedy tokens [4, T] and depth 2's [4, T - 2] (guesses of tokens i + 3)."""
        module = model._module(params)
        x = module.hidden(tokens[:, :-1])[0]
        h = _depth_states(module, x, tokens)[-1][1]
        return jnp.argmax(module.logits(x), axis=-1), jnp.argmax(module.logits(h, mtp_depth=2), axis=-1)

    tokens = batch["tokens"]
    main, draft = greedy(params, tokens)
    offered = np.ones((4, T - 2), bool)
    offered[3, 9 - 3:] = False  # token 9 is padding: positions 6.. of row 3 have a target chain reaching it
    accepted = int(np.sum((np.asarray(draft) == np.asarray(main[:, 2:])) & offered))
    assert got["mtp_offered"] == offered.sum() == 3 * (T - 2) + 6
    assert got["mtp_accepted"] == accepted and 0 < accepted < offered.sum(), (accepted, offered.sum())
    assert got["mtp_counts"].tolist() == [np.sum(chain_weights(target_weights(batch["segment_ids"]), k))
                                          for k in (1, 2)]

    @jax.jit
    def training_mtp_loss(params, batch):
        x = model.hidden_with_aux(params, batch["tokens"][:, :-1], batch["positions"][:, :-1],
                                  batch["segment_ids"][:, :-1])[0]
        return mtp_terms(model, params, x, batch, None)["mtp_loss"]

    np.testing.assert_allclose(np.mean(got["mtp_loss_sums"] / got["mtp_counts"]),  # training's MTP loss
                               training_mtp_loss(params, batch), rtol=1e-6)

    tiled = sums(4)[2]
    for key in got:
        np.testing.assert_allclose(tiled[key], got[key], rtol=1e-5, err_msg=key)
    record = {"step": 5, "eval_loss": 2.0, "eval_perplexity": 7.39, "eval_tokens": 40, "eval_batches": 1,
              "eval_seconds": 0.1, "eval_mtp_loss": 2.5, "eval_mtp_acceptance_rate_percent": 37.5}
    assert "loss 2.0000 (MTP 2.5000) | MTP acceptance 37.5% | perplexity" in format_eval(record)


def test_eval_computes_the_main_logits_once_with_vocab_tiling():
    """With mtp_eval_target_module and num_vocab_tiling > 1 the main model's loss and greedy tokens
    come from one pass over each chunk's logits: the eval program has four products with the
    vocabulary (the main output, the two depths' losses, the target depth's greedy tokens), where
    computing the loss and the greedy tokens apart had five."""
    cfg = tiny_config(mtp_num_layers=2, mtp_eval_target_module=2, num_vocab_tiling=4).model
    model = build_model(cfg)
    params, batch = model.init(jax.random.key(4)), _batch(rows=4, seed=5)
    program = jax.jit(lambda p, b: eval_sums(model, p, b)).lower(params, batch).as_text()
    logits = [line for line in program.splitlines()
              if "dot_general" in line and re.search(rf"x{cfg.vocab_size}xf32>\s*$", line)]
    assert len(logits) == 4, logits


def test_the_main_model_is_the_same_with_or_without_mtp():
    """The same seed gives the same main-model weights (the depths are initialized last), the
    same logits and the same next-token loss; with mtp_loss_scaling_factor=0 training follows the
    run without MTP step for step."""
    plain = build_model(tiny_config().model)
    with_mtp = build_model(tiny_config(mtp_num_layers=1).model)
    p0, p1 = jax.jit(plain.init)(jax.random.key(3)), jax.jit(with_mtp.init)(jax.random.key(3))
    assert set(p1) - set(p0) == {"mtp_1"}
    jax.tree.map(np.testing.assert_array_equal, p0, {k: v for k, v in p1.items() if k != "mtp_1"})
    batch = _batch()
    loss = lambda model, params: jax.jit(lambda p: loss_terms(model, p, batch, None)[0])(params)  # noqa: E731
    np.testing.assert_array_equal(loss(plain, p0), loss(with_mtp, p1))


@pytest.mark.slow
def test_training_with_mtp_on_one_device_and_on_a_sharded_mesh(tmp_path):
    """A weight of 0 trains the main model exactly as without MTP; with MTP on, the next-token
    loss changes, the MTP loss falls, and fsdp 2 x tensor 2 x sequence 2 gives one device's losses (the
    depths' shifts cross the sequence split), and its evaluations' (the MTP loss and depth 2's
    acceptance rate among them). The decoder is one layer (what is tested is the depths after it):
    the four runs' programs compile in about half the time of three layers'."""
    evals, reports = {}, {}

    def losses(name, devices, **keys):
        cfg = tiny_config(tmp_path / name, steps=4, per_device_batch_size=8 / devices, enable_checkpointing=False,
                          base_num_decoder_layers=1, **keys)
        reports[name] = run(cfg, jax.devices()[:devices])
        records = [json.loads(line) for line in (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()]
        evals[name] = [r for r in records if "eval_loss" in r]
        return [r for r in records if "eval_loss" not in r]

    plain = losses("plain", 1)
    silent = losses("silent", 1, mtp_num_layers=1, mtp_loss_scaling_factor=0.0)
    np.testing.assert_allclose([r["loss"] for r in silent], [r["loss"] for r in plain], rtol=1e-6)
    evaluated = dict(eval_interval=2, eval_steps=2, mtp_eval_target_module=2)
    one = losses("one", 1, mtp_num_layers=2, mtp_loss_scaling_factor=0.5, **evaluated)
    assert not np.allclose([r["loss"] for r in one][1:], [r["loss"] for r in plain][1:], rtol=1e-6)
    assert one[-1]["mtp_loss"] < one[0]["mtp_loss"] and "(MTP " in format_record(one[0])
    sharded = losses("sharded", 8, mtp_num_layers=2, mtp_loss_scaling_factor=0.5, ici_fsdp_parallelism=2,
                     ici_tensor_parallelism=2, ici_sequence_parallelism=2, **evaluated)
    for key in ("loss", "mtp_loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in sharded], [r[key] for r in one], rtol=2e-4, err_msg=key)
    assert [r["step"] for r in evals["one"]] == [2, 4] and evals["one"][-1]["eval_mtp_loss"] > 1.0
    for key in ("eval_mtp_loss", "eval_mtp_acceptance_rate_percent"):  # the report keeps the last evaluation's
        assert reports["one"][f"final_{key}"] == evals["one"][-1][key]
    for key in ("eval_loss", "eval_mtp_loss", "eval_mtp_acceptance_rate_percent"):
        np.testing.assert_allclose([r[key] for r in evals["sharded"]], [r[key] for r in evals["one"]], rtol=2e-4,
                                   err_msg=key)
    # the step's FLOPs count the depths: a block, its projection and the output layer each
    base, extra = tiny_config().model, tiny_config(mtp_num_layers=2).model
    d, v = base.emb_dim, base.vocab_size
    per_block = (matmul_params(base) - d * v) // base.num_decoder_layers
    assert matmul_params(extra) - matmul_params(base) == 2 * (per_block + 2 * d * d + d * v)


# A MoE depth under expert parallelism (expert 4 x fsdp 2, dropless) gives one device's next-token and MTP losses,
# router losses and expert loads: test_families.test_deepseek_expert_parallel_gives_the_same_losses_as_one_device
# runs deepseek with one MTP depth (one pair of runs for both).


@pytest.mark.slow
def test_moe_depths_add_their_router_loss_and_move_their_routed_bias():
    """deepseek with one MTP depth whose loss is weighted 0: the step moves the depth's expert bias
    by the update rate, towards balance, as it moves the decoder's; the depth's router changes
    through its load-balancing loss alone (with that loss weighted 0 too, it stays as it was). The
    decoder is one expert layer (no dense one): each of the two steps compiles in a third of the time."""
    from tessera.step import create_state, make_train_step, setup

    def one_step(router_weight):
        cfg = tiny_config(**{**FAMILIES["deepseek"], "base_num_decoder_layers": 1, "first_num_dense_layers": 0},
                          mtp_num_layers=1, mtp_loss_scaling_factor=0.0, adam_weight_decay=0.0,
                          load_balance_loss_weight=router_weight, routed_bias_update_rate=0.01)
        trainer = setup(cfg, jax.devices()[:1])
        state = create_state(trainer, 0)
        batch = _batch(rows=trainer.plan.global_batch)
        loads = jax.jit(lambda p: loss_terms(trainer.model, p, batch, None)[2][MTP_LOAD])(state["params"])
        new_state, stats = jax.jit(make_train_step(trainer, 0))(state, batch)
        old, new = state["params"]["mtp_1"]["block"]["mlp"], new_state["params"]["mtp_1"]["block"]["mlp"]
        return loads, stats, {k: np.asarray(new[k] - old[k]) for k in ("routed_bias_e", "router_de")}

    loads, stats, moved = one_step(0.1)
    assert loads.shape == (1, 8) and np.isclose(float(jnp.mean(loads)), 1.0)  # [depths, experts]; fair share 1
    np.testing.assert_allclose(moved["routed_bias_e"], 0.01 * np.sign(1.0 - np.asarray(loads[0])), atol=1e-7)
    assert MTP_LOAD not in stats and float(stats["mtp_moe_load_balance_loss"]) > 0
    assert np.abs(moved["router_de"]).max() > 0
    assert np.abs(one_step(0.0)[2]["router_de"]).max() == 0


@pytest.mark.parametrize("family", ["llama2", "gpt3", "gemma", "deepseek"])
def test_counts_match_the_model_we_build_with_mtp(family):
    m = tiny_config(**FAMILIES.get(family, {}), mtp_num_layers=2).model
    built = sum(x.size for x in jax.tree.leaves(build_model(m).param_shapes()))
    assert count_params(m).total == built


@pytest.mark.parametrize("keys,message", [
    (dict(FAMILIES["gemma2"], mtp_num_layers=1), "gemma2's blocks hold 2 layers"),
    (dict(FAMILIES["llama4"], mtp_num_layers=1), r"llama4's blocks hold 4 layers \(3 chunked rotary and 1 NoPE\)"),
    (dict(mtp_num_layers=12), "leaves nothing to predict"),
    (dict(mtp_num_layers=1, ici_pipeline_parallelism=2, ici_fsdp_parallelism=1), "not supported with pipeline"),
    (dict(mtp_num_layers=2, mtp_eval_target_module=3), "but it has 2 .* use 1 to 2, or 0"),
    (dict(mtp_eval_target_module=1), "mtp_num_layers=0 builds none"),
])
def test_mtp_config_errors(keys, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**keys)


def test_mtp_with_pipeline_stages_names_the_stage_key_the_user_set():
    """The error said "ici/dcn_pipeline_parallelism=1", so its note of where the keys were set named
    dcn_pipeline_parallelism from base.yml, not the ici_pipeline_parallelism=2 of the command line."""
    from tessera.config import load_config

    base = str(Path(__file__).resolve().parent.parent / "configs" / "base.yml")
    with pytest.raises(ConfigError, match=r"^mtp_num_layers=1 is not supported with pipeline parallelism "
                                          r"\(ici_pipeline_parallelism=2: .*; set mtp_num_layers=0 or "
                                          r"ici_pipeline_parallelism=1 \(mtp_num_layers and ici_pipeline_parallelism "
                                          r"from the command line\)$"):
        load_config([base, "mtp_num_layers=1", "ici_pipeline_parallelism=2"], env={})


@pytest.mark.parametrize("scan_layers", [True, False])
def test_deepseek_mtp_layers_convert_to_hugging_face_and_back(scan_layers, tmp_path, capsys):
    """DeepSeek-V3 stores depth k as layer num_decoder_layers + k - 1 (a decoder layer with enorm,
    hnorm, eh_proj [D, 2D] = [embedding | hidden] inputs, shared_head.norm, and copies of the
    embedding and output layer); the round trip is exact, and mtp_num_layers decides what is read."""
    from tessera.checkpointing import load_parameters
    from tessera.tools import hf_checkpoint, hf_reader
    from tessera.tools.convert import main
    from tessera.tools.estimate import load_model_config
    from tessera.tools.hf_configs import as_overrides

    model_keys = {k: v for k, v in tiny_config().model.__dict__.items() if k.startswith("base_") or k in (
        "head_dim", "vocab_size")}
    keys = ["model_name=default", *as_overrides({**model_keys, **FAMILIES["deepseek"], "scan_layers": scan_layers})]
    cfg = load_model_config(None, [*keys, "mtp_num_layers=1"])
    targets = hf_checkpoint.param_targets(cfg)
    rng = np.random.default_rng(0)
    params = hf_checkpoint._nest({k: rng.standard_normal(t.shape).astype(t.dtype) for k, t in targets.items()})
    hf_checkpoint.save_params(tmp_path / "tessera", params)
    assert main(["tessera-to-hf", str(tmp_path / "tessera"), str(tmp_path / "hf"), *keys, "mtp_num_layers=1"]) == 0

    reader, layer, d = hf_reader.Reader(tmp_path / "hf"), "model.layers.3.", cfg.model.emb_dim
    assert reader.config["num_nextn_predict_layers"] == 1
    mtp = params["mtp_1"]
    np.testing.assert_array_equal(reader.get(layer + "eh_proj.weight")[:, :d], mtp["projection_ced"][0].T)
    np.testing.assert_array_equal(reader.get(layer + "eh_proj.weight")[:, d:], mtp["projection_ced"][1].T)
    np.testing.assert_array_equal(reader.get(layer + "enorm.weight"), mtp["embedding_norm"]["scale"])
    np.testing.assert_array_equal(reader.get(layer + "shared_head.norm.weight"), mtp["output_norm"]["scale"])
    np.testing.assert_array_equal(reader.get(layer + "embed_tokens.weight"), params["token_embedder"]["table_vd"])
    np.testing.assert_array_equal(reader.get(layer + "shared_head.head.weight"), params["logits_dense_dv"].T)
    np.testing.assert_array_equal(reader.get(layer + "mlp.gate.e_score_correction_bias"),
                                  mtp["block"]["mlp"]["routed_bias_e"])

    assert main(["hf-to-tessera", str(tmp_path / "hf"), str(tmp_path / "back"), *keys, "mtp_num_layers=1"]) == 0
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                            build_model(cfg.model).param_shapes())
    jax.tree.map(np.testing.assert_array_equal, load_parameters(str(tmp_path / "back"), abstract), params)

    # without MTP the stored depth is left out (one log line); asking for more depths than stored is an error
    assert main(["hf-to-tessera", str(tmp_path / "hf"), str(tmp_path / "plain"), *keys]) == 0
    capsys.readouterr()
    assert main(["hf-to-tessera", str(tmp_path / "hf"), str(tmp_path / "two"), *keys, "mtp_num_layers=2"]) == 2
    assert "the checkpoint stores 1 multi-token-prediction layers" in capsys.readouterr().err
    assert not (tmp_path / "two").exists()


def test_mtp_with_micro_batches_trains_as_one_batch_when_their_padding_differs():
    """gradient_accumulation_steps=2 took each micro-batch's own mean MTP loss, times its target count: with
    micro-batches of unequal padding the step's gradients and logged mtp_loss were not one batch's (with two
    depths and three layers: grad norm 3.80327 against 3.80343, parameters 0.02 apart after one step). The depths' sums now add up over the step."""
    from tessera.step import create_state, make_train_step, setup

    lengths = np.array([13, 3, 9, 6])  # the first micro-batch has 14 targets, the second 13
    batch = _batch(rows=4, seed=3, segments=(np.arange(T + 1)[None] < lengths[:, None]).astype(np.int32))
    results = []
    for accum in (1, 2):
        trainer = setup(tiny_config(mtp_num_layers=1, base_num_decoder_layers=1, per_device_batch_size=4,
                                    gradient_accumulation_steps=accum),
                        jax.devices()[:1])
        results.append(jax.jit(make_train_step(trainer, 0))(create_state(trainer, 0), batch))
    (one, one_stats), (two, two_stats) = results
    for key in ("loss", "mtp_loss", "grad_norm"):
        np.testing.assert_allclose(two_stats[key], one_stats[key], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), two["params"], one["params"])


def test_the_training_objective_adds_the_scaling_factor_times_the_mean_over_depths():
    """base.yml: mtp_loss_scaling_factor weighs the multi-token-prediction loss, "the mean over its blocks", in
    the training loss. The step's objective (a sum over target tokens) is the token losses' sum plus factor x
    count x the mean over the two depths of each depth's mean loss; the depths' counts differ (a row ends in
    padding), so a mean over all their tokens, or their sum, would differ too."""
    from tessera.step import mtp_step_counts, objective_fn

    model = build_model(tiny_config(mtp_num_layers=2, mtp_loss_scaling_factor=0.3).model)
    params = model.init(jax.random.key(2))
    batch = _batch(rows=2, seed=6)
    batch["segment_ids"] = batch["segment_ids"].at[1, 7:].set(0)
    counts, scale = mtp_step_counts(batch["segment_ids"], 2)
    objective, (loss_sum, count, aux) = jax.jit(
        lambda p: objective_fn(model, False)(p, batch, None, scale))(params)
    assert counts.tolist() == [2 * (T - 1) - 6, 2 * (T - 2) - 6] and float(count) == 2 * T - 6
    depth_means = np.asarray(aux["mtp_loss_sums"]) / np.asarray(counts)
    want = float(loss_sum) + 0.3 * float(count) * np.mean(depth_means)
    np.testing.assert_allclose(float(objective), want, rtol=1e-6)
    assert float(objective) - float(loss_sum) > 1.0  # the MTP term is there to be weighed
