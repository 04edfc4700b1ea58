"""How Hugging Face checkpoints map onto Tessera's parameters, per family (their `config.json`
maps onto Tessera's keys in `tessera.tools.hf_configs`).

`layout_for(cfg)` gives the tensor rules of a family: the Llama-like families' and GPT-2's here,
DeepSeek's, Llama 4's and Qwen3-Next's in `tessera.tools.hf_family_layouts`. A `Rule` links one or more Hugging Face
tensors to one or more Tessera parameters with a function each way; both directions are exact
(transposes, reshapes and stacking only), so a round trip gives the same bytes.

Tessera paths are written relative to the model ("token_embedder/table_vd") or, for layer
rules, relative to one decoder layer ("attention/wq_dnh"); `layer_prefix` places a layer in
the parameter tree (a scanned stack, unscanned `layers_<b>`, and Gemma 2's local/global pairs).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from tessera.config import ConfigError, ModelConfig
from tessera.config.fields import OLMO_BLOCKS
from tessera.config.layers import LAYERS_PER_BLOCK


@dataclasses.dataclass(frozen=True)
class Rule:
    ours: tuple[str, ...]  # Tessera parameter paths
    hf: tuple[str, ...]  # Hugging Face tensor names ({i}: layer index)
    to_ours: Callable[..., tuple[np.ndarray, ...]]  # hf arrays -> ours arrays
    to_hf: Callable[..., tuple[np.ndarray, ...]]  # ours arrays -> hf arrays


def same(ours: str, hf: str) -> Rule:
    return Rule((ours,), (hf,), lambda a: (a,), lambda a: (a,))


def linear(ours: str, hf: str, shape: tuple[int, ...]) -> Rule:
    """A torch Linear weight [out, in] <-> ours [in, ...] = weight.T reshaped to `shape`."""
    return Rule((ours,), (hf,), lambda w: (np.ascontiguousarray(w.T).reshape(shape),),
                lambda w: (np.ascontiguousarray(w.reshape(shape[0], -1).T),))


def linear_out(ours: str, hf: str, shape: tuple[int, ...]) -> Rule:
    """An output projection [out, in...] whose inputs are several of our axes (heads, head_dim)."""
    return Rule((ours,), (hf,), lambda w: (np.ascontiguousarray(w.T).reshape(shape),),
                lambda w: (np.ascontiguousarray(w.reshape(-1, shape[-1]).T),))


def reshaped(ours: str, hf: str, shape: tuple[int, ...], hf_shape: tuple[int, ...]) -> Rule:
    """Same element order, other shape (GPT-2's Conv1D weights are already [in, out])."""
    return Rule((ours,), (hf,), lambda w: (w.reshape(shape),), lambda w: (w.reshape(hf_shape),))


def fused_linear(ours: str, hfs: tuple[str, ...]) -> Rule:
    """Torch Linear weights [out, in] <-> ours [in, len(hfs), out], stacked on axis 1 (fused_mlp)."""
    return Rule((ours,), hfs, lambda *ws: (np.stack([w.T for w in ws], axis=1),),
                lambda w: tuple(np.ascontiguousarray(w[:, i].T) for i in range(w.shape[1])))


def fused(ours: str, rules: list[Rule], axis: int) -> Rule:
    """Single-tensor rules (query, key, value) <-> one parameter holding their results stacked on `axis`
    (fused_qkv: weights [D, 3, N, H] on axis 1, biases [3, N, H] on axis 0)."""
    return Rule((ours,), tuple(r.hf[0] for r in rules),
                lambda *ws: (np.stack([r.to_ours(w)[0] for r, w in zip(rules, ws)], axis=axis),),
                lambda w: tuple(r.to_hf(np.take(w, j, axis=axis))[0] for j, r in enumerate(rules)))


def qkv_rules(m: ModelConfig, rules: list[Rule], ours: str, axis: int) -> list[Rule]:
    """The query, key and value rules as they are, or fused into `ours` when the model has fused_qkv."""
    return [fused(ours, rules, axis)] if m.fused_qkv else rules


def experts(ours: str, hf: str, m: ModelConfig, shape: tuple[int, int]) -> Rule:
    """E per-expert torch Linear weights [out, in] <-> ours [E, in, out]."""
    names = tuple(hf.replace("{e}", str(e)) for e in range(m.num_experts))
    return Rule((ours,), names, lambda *ws: (np.stack([np.ascontiguousarray(w.T) for w in ws]),),
                lambda w: tuple(np.ascontiguousarray(x.T) for x in w))


@dataclasses.dataclass(frozen=True)
class Layout:
    model_rules: list[Rule]
    layer_rules: list[Rule]
    hf_layer: str  # prefix of layer i's tensors, e.g. "model.layers.{i}."
    layers_per_block: int = 1
    num_layers: int = 0  # layers of the model (gemma3: those past the last whole block are the `tail` block's)
    prefix_layers: int = 0  # deepseek: the first layers are dense, stacked as `dense_layers`
    prefix_rules: list[Rule] = dataclasses.field(default_factory=list)
    # deepseek: the rules of each multi-token-prediction depth (full paths of ours), stored as the
    # Hugging Face layers after the decoder's (num_decoder_layers + k - 1 for depth k)
    mtp_rules: list[list[Rule]] = dataclasses.field(default_factory=list)
    # llama4: layers of two kinds (dense and expert MLPs) in one block: layer i's rules, when they differ
    rules_of_layer: Callable[[int], list[Rule]] | None = None

    def rules_for(self, i: int) -> list[Rule]:
        """The tensor rules of Hugging Face layer i."""
        if i < self.prefix_layers:
            return self.prefix_rules
        return self.rules_of_layer(i) if self.rules_of_layer else self.layer_rules

    def layer_prefix(self, i: int, scanned: bool) -> tuple[str, int | None]:
        """(our path prefix, index in the stacked axis or None) of Hugging Face layer i."""
        if i < self.prefix_layers:
            return ("dense_layers/", i) if scanned else (f"dense_layers_{i}/", None)
        i -= self.prefix_layers
        block, sub = divmod(i, self.layers_per_block)
        if self.layers_per_block == 2:
            inner = ("local_layer/", "global_layer/")[sub]
        else:
            inner = f"layer_{sub}/" if self.layers_per_block > 1 else ""
        if self.layers_per_block > 1 and block == (self.num_layers - self.prefix_layers) // self.layers_per_block:
            return "tail/" + inner, None
        return ("layers/" + inner, block) if scanned else (f"layers_{block}/" + inner, None)


def interleaved(ours: tuple[str, str], hf: str) -> Rule:
    """A fused tensor [..., 2F] whose last axis alternates the two (gpt-oss's gate_up_proj: gate
    at even indices, up at odd) <-> ours, two [..., F] tensors."""
    def split(w):
        return np.ascontiguousarray(w[..., 0::2]), np.ascontiguousarray(w[..., 1::2])

    def join(a, b):
        return (np.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1]),)

    return Rule(ours, (hf,), split, join)


def _attention_biases(m: ModelConfig) -> list[Rule]:
    """q/k/v/o projection biases (attention_bias) in torch Linear's flat [out] layout (Qwen2 has no o bias)."""
    n, k, h = m.num_query_heads, m.num_kv_heads, m.head_dim
    qkv = [reshaped("attention/bq_nh", "self_attn.q_proj.bias", (n, h), (n * h,)),
           reshaped("attention/bk_kh", "self_attn.k_proj.bias", (k, h), (k * h,)),
           reshaped("attention/bv_kh", "self_attn.v_proj.bias", (k, h), (k * h,))]
    out = [] if m.decoder_block == "qwen2" else [same("attention/bo_d", "self_attn.o_proj.bias")]
    return qkv_rules(m, qkv, "attention/bqkv_cnh", 0) + out


def check_hf_has(m: ModelConfig, family: str) -> None:
    """ConfigError for an option of ours that the family's Hugging Face model has no tensor for."""
    from tessera.tools.hf_configs import HF_ATTENTION_BIAS, HF_MLP_BIAS, HF_MODEL_TYPES

    kind = {v: k for k, v in HF_MODEL_TYPES.items()}[family]
    missing = [key for key, ok in (("attention_bias", kind in HF_ATTENTION_BIAS or kind == "qwen2"), ("attention_sink", kind == "gpt_oss"),
                                   ("mlp_bias", kind in HF_MLP_BIAS or kind == "gpt_oss")) if getattr(m, key) and not ok]
    if kind == "gpt_oss" and not (m.attention_sink and m.mlp_bias):
        missing.append("attention_sink=false or mlp_bias=false (gpt-oss always has its sinks and expert biases)")
    if kind == "qwen2" and not m.attention_bias:
        missing.append("attention_bias=false (Qwen2 always has its query, key and value biases)")
    if missing:
        raise ConfigError(f"{', '.join(missing)}: Hugging Face's {kind} model has no such tensors, so this "
                          f"decoder_block={family} model cannot be converted")


def _llama_like(m: ModelConfig, family: str) -> Layout:
    d, n, k, h = m.emb_dim, m.num_query_heads, m.num_kv_heads, m.head_dim
    check_hf_has(m, family)
    model = [same("token_embedder/table_vd", "model.embed_tokens.weight"), same("final_norm/scale", "model.norm.weight")]
    if not m.logits_via_embedding:
        model.append(linear("logits_dense_dv", "lm_head.weight", (d, m.vocab_size)))
    qkv = [linear("attention/wq_dnh", "self_attn.q_proj.weight", (d, n, h)),
           linear("attention/wk_dkh", "self_attn.k_proj.weight", (d, k, h)),
           linear("attention/wv_dkh", "self_attn.v_proj.weight", (d, k, h))]
    layer = qkv_rules(m, qkv, "attention/wqkv_dcnh", 1) + [
        linear_out("attention/wo_nhd", "self_attn.o_proj.weight", (n, h, d))]
    olmo = family in OLMO_BLOCKS
    if not olmo:  # (OLMo 2 and 3 have no norm before attention)
        layer.append(same("pre_attention_norm/scale", "input_layernorm.weight"))
    if m.attention_bias:
        layer += _attention_biases(m)
    if family in ("qwen3", "qwen3_moe", "gemma3"):
        layer += [same("attention/query_norm/scale", "self_attn.q_norm.weight"),
                  same("attention/key_norm/scale", "self_attn.k_norm.weight")]
    if olmo:  # one norm over all heads: a flat [heads * head_dim] scale there
        layer += [reshaped("attention/query_norm/scale", "self_attn.q_norm.weight", (n, h), (n * h,)),
                  reshaped("attention/key_norm/scale", "self_attn.k_norm.weight", (k, h), (k * h,))]
    layer += _llama_like_mlp(m, family)
    if family in ("gemma2", "gemma3") or olmo:  # norms after attention and the MLP (Gemma's before them too)
        layer += [same("post_attention_norm/scale", "post_attention_layernorm.weight"),
                  same("post_mlp_norm/scale", "post_feedforward_layernorm.weight")]
    if family in ("gemma2", "gemma3"):
        layer.append(same("pre_mlp_norm/scale", "pre_feedforward_layernorm.weight"))
    elif not olmo:
        layer.append(same("pre_mlp_norm/scale", "post_attention_layernorm.weight"))
    return Layout(model, layer, "model.layers.{i}.", LAYERS_PER_BLOCK.get(family, 1), m.num_decoder_layers)


def _llama_like_mlp(m: ModelConfig, family: str) -> list[Rule]:
    """The rules of a llama-like layer's MLP: its experts and router, or its dense (or fused) projections."""
    d, f = m.emb_dim, m.mlp_dim
    mlp: list[Rule] = []
    if family == "qwen3_moe":
        mlp += [
            linear("mlp/router_de", "mlp.gate.weight", (d, m.num_experts)),
            experts("mlp/wi_0", "mlp.experts.{e}.gate_proj.weight", m, (d, f)),
            experts("mlp/wi_1", "mlp.experts.{e}.up_proj.weight", m, (d, f)),
            experts("mlp/wo_efd", "mlp.experts.{e}.down_proj.weight", m, (f, d)),
        ]
    elif family == "mixtral":
        mlp += [
            linear("mlp/router_de", "block_sparse_moe.gate.weight", (d, m.num_experts)),
            experts("mlp/wi_0", "block_sparse_moe.experts.{e}.w1.weight", m, (d, f)),
            experts("mlp/wi_1", "block_sparse_moe.experts.{e}.w3.weight", m, (d, f)),
            experts("mlp/wo_efd", "block_sparse_moe.experts.{e}.w2.weight", m, (f, d)),
        ]
    elif family == "gpt_oss":
        fe, e = m.expert_mlp_dim, m.num_experts
        mlp += [
            linear("mlp/router_de", "mlp.router.weight", (d, e)), same("mlp/router_bias_e", "mlp.router.bias"),
            same("attention/sinks_n", "self_attn.sinks"),
            interleaved(("mlp/wi_0", "mlp/wi_1"), "mlp.experts.gate_up_proj"),
            interleaved(("mlp/bi_0_ef", "mlp/bi_1_ef"), "mlp.experts.gate_up_proj_bias"),
            reshaped("mlp/wo_efd", "mlp.experts.down_proj", (e, fe, d), (e, fe, d)),
            same("mlp/bo_ed", "mlp.experts.down_proj_bias"),
        ]
    elif m.fused_mlp:
        mlp += [fused_linear("mlp/wi_dcf", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
                  linear("mlp/wo_fd", "mlp.down_proj.weight", (f, d))]
        if m.mlp_bias:
            mlp += [Rule(("mlp/bi_cf",), ("mlp.gate_proj.bias", "mlp.up_proj.bias"), lambda *bs: (np.stack(bs),),
                           lambda b: tuple(np.ascontiguousarray(x) for x in b)), same("mlp/bo_d", "mlp.down_proj.bias")]
    else:
        mlp += [linear("mlp/wi_0", "mlp.gate_proj.weight", (d, f)), linear("mlp/wi_1", "mlp.up_proj.weight", (d, f)),
                  linear("mlp/wo_fd", "mlp.down_proj.weight", (f, d))]
        if m.mlp_bias:
            mlp += [same("mlp/bi_0", "mlp.gate_proj.bias"), same("mlp/bi_1", "mlp.up_proj.bias"),
                      same("mlp/bo_d", "mlp.down_proj.bias")]
    return mlp


def _gpt2(m: ModelConfig) -> Layout:
    d, n, h = m.emb_dim, m.num_query_heads, m.head_dim
    if m.attention_sink:
        raise ConfigError("attention_sink=true: Hugging Face's gpt2 model has no sink logits, so this "
                          "decoder_block=gpt3 model cannot be converted")
    if not m.trainable_position_size:  # it wrote n_positions=0 and no wpe: transformers loaded it and failed to run
        raise ConfigError("trainable_position_size=0 (fixed sinusoidal positions): Hugging Face's gpt2 model adds a "
                          "learned position table (transformer.wpe), so this decoder_block=gpt3 model cannot be "
                          "converted")
    model = [same("token_embedder/table_vd", "transformer.wte.weight"),
             same("final_norm/scale", "transformer.ln_f.weight"), same("final_norm/bias", "transformer.ln_f.bias"),
             same("position_embedder_pd", "transformer.wpe.weight")]
    if not m.logits_via_embedding:
        model.append(linear("logits_dense_dv", "lm_head.weight", (d, m.vocab_size)))
    if m.fused_qkv:
        qkv = [reshaped("attention/wqkv_dcnh", "attn.c_attn.weight", (d, 3, n, h), (d, 3 * n * h)),
               reshaped("attention/bqkv_cnh", "attn.c_attn.bias", (3, n, h), (3 * n * h,))]
    else:
        names_w = ("attention/wq_dnh", "attention/wk_dkh", "attention/wv_dkh")
        names_b = ("attention/bq_nh", "attention/bk_kh", "attention/bv_kh")
        qkv = [Rule(names_w, ("attn.c_attn.weight",), lambda w: tuple(w.reshape(d, 3, n, h)[:, j] for j in range(3)),
                    lambda *ws: (np.stack(ws, axis=1).reshape(d, 3 * n * h),)),
               Rule(names_b, ("attn.c_attn.bias",), lambda b: tuple(b.reshape(3, n, h)),
                    lambda *bs: (np.stack(bs).reshape(-1),))]
    layer = qkv + [
        reshaped("attention/wo_nhd", "attn.c_proj.weight", (n, h, d), (n * h, d)),
        same("attention/bo_d", "attn.c_proj.bias"),
        same("pre_attention_norm/scale", "ln_1.weight"), same("pre_attention_norm/bias", "ln_1.bias"),
        same("pre_mlp_norm/scale", "ln_2.weight"), same("pre_mlp_norm/bias", "ln_2.bias"),
        same("mlp/wi_0", "mlp.c_fc.weight"), same("mlp/bi_0", "mlp.c_fc.bias"),
        same("mlp/wo_fd", "mlp.c_proj.weight"), same("mlp/bo_d", "mlp.c_proj.bias"),
    ]
    return Layout(model, layer, "transformer.h.{i}.")


def layout_for(m: ModelConfig) -> Layout:
    """The tensor rules of `m`'s family; ConfigError for a family with no Hugging Face counterpart."""
    if m.decoder_block in ("llama2", "mistral", "mixtral", "gemma", "gemma2", "qwen2", "qwen3", "qwen3_moe", "gemma3",
                           "gpt_oss", "olmo3", "olmo2"):
        return _llama_like(m, m.decoder_block)
    if m.decoder_block == "gpt3":
        return _gpt2(m)
    from tessera.tools import hf_family_layouts as families  # (they build on this module's rules)

    if m.decoder_block == "deepseek":
        return families.deepseek(m)
    if m.decoder_block == "llama4":
        return families.llama4(m)
    if m.decoder_block == "qwen3_next":
        return families.qwen3_next(m)
    raise ConfigError(f"decoder_block={m.decoder_block} has no Hugging Face layout")
