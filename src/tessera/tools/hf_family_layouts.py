"""The Hugging Face layouts of the families whose tensors are not Llama's (`hf_layouts.layout_for` picks them):
DeepSeek's multi-head latent attention (its interleaved rotary dimensions reordered) and multi-token-prediction
layers, Llama 4's interleaved rotary pairs and layers of two kinds, and Qwen3-Next's Gated DeltaNet and gated
attention layers. Built from `hf_layouts`' rules, exact both ways as they are."""

from __future__ import annotations

import numpy as np

from tessera.config import ConfigError, ModelConfig
from tessera.config.layers import LAYERS_PER_BLOCK
from tessera.tools.hf_layouts import Layout, Rule, check_hf_has, experts, linear, linear_out, qkv_rules, same


def _rope_order(hr: int) -> np.ndarray:
    """Our rotary dimension j holds DeepSeek's interleaved dimension order[j]: evens, then odds."""
    return np.concatenate([np.arange(0, hr, 2), np.arange(1, hr, 2)])


def _rope_last(w: np.ndarray, hr: int, inverse: bool = False) -> np.ndarray:
    """w with the last `hr` entries of its last axis reordered (`_rope_order`), or put back."""
    order = _rope_order(hr)
    if inverse:
        order = np.argsort(order)
    return np.concatenate([w[..., :-hr], w[..., -hr:][..., order]], axis=-1)


def _mla_linear(ours: str, hf: str, shape: tuple[int, ...], hr: int) -> Rule:
    """A torch Linear [out, in] whose outputs end (per head, or in all) in interleaved rotary dims."""
    return Rule((ours,), (hf,), lambda w: (_rope_last(np.ascontiguousarray(w.T).reshape(shape), hr),),
                lambda w: (np.ascontiguousarray(_rope_last(w, hr, inverse=True).reshape(shape[0], -1).T),))


def deepseek(m: ModelConfig) -> Layout:
    d, n, f = m.emb_dim, m.num_query_heads, m.expert_mlp_dim
    if m.mlp_bias:
        raise ConfigError("mlp_bias=true: Hugging Face's deepseek_v3 model has no MLP biases, so this "
                          "decoder_block=deepseek model cannot be converted")
    hn, hr, hv, r, rq = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank, m.q_lora_rank
    model = [same("token_embedder/table_vd", "model.embed_tokens.weight"), same("final_norm/scale", "model.norm.weight")]
    if not m.logits_via_embedding:
        model.append(linear("logits_dense_dv", "lm_head.weight", (d, m.vocab_size)))
    if rq:
        query = [linear("attention/wq_a_dr", "self_attn.q_a_proj.weight", (d, rq)),
                 same("attention/q_norm/scale", "self_attn.q_a_layernorm.weight"),
                 _mla_linear("attention/wq_b_rnh", "self_attn.q_b_proj.weight", (rq, n, hn + hr), hr)]
    else:
        query = [_mla_linear("attention/wq_dnh", "self_attn.q_proj.weight", (d, n, hn + hr), hr)]
    common = query + [
        _mla_linear("attention/wkv_a_dr", "self_attn.kv_a_proj_with_mqa.weight", (d, r + hr), hr),
        same("attention/kv_norm/scale", "self_attn.kv_a_layernorm.weight"),
        linear("attention/wkv_b_rnh", "self_attn.kv_b_proj.weight", (r, n, hn + hv)),
        linear_out("attention/wo_nhd", "self_attn.o_proj.weight", (n, hv, d)),
        same("pre_attention_norm/scale", "input_layernorm.weight"),
        same("pre_mlp_norm/scale", "post_attention_layernorm.weight"),
    ]
    dense = common + [linear("mlp/wi_0", "mlp.gate_proj.weight", (d, m.mlp_dim)),
                      linear("mlp/wi_1", "mlp.up_proj.weight", (d, m.mlp_dim)),
                      linear("mlp/wo_fd", "mlp.down_proj.weight", (m.mlp_dim, d))]
    moe = common + [
        linear("mlp/router_de", "mlp.gate.weight", (d, m.num_experts)),
        experts("mlp/wi_0", "mlp.experts.{e}.gate_proj.weight", m, (d, f)),
        experts("mlp/wi_1", "mlp.experts.{e}.up_proj.weight", m, (d, f)),
        experts("mlp/wo_efd", "mlp.experts.{e}.down_proj.weight", m, (f, d)),
    ]
    if m.routed_bias:
        moe.append(same("mlp/routed_bias_e", "mlp.gate.e_score_correction_bias"))
    if m.shared_experts:
        fs = m.shared_experts * f
        moe += [linear("mlp/shared/wi_0", "mlp.shared_experts.gate_proj.weight", (d, fs)),
                linear("mlp/shared/wi_1", "mlp.shared_experts.up_proj.weight", (d, fs)),
                linear("mlp/shared/wo_fd", "mlp.shared_experts.down_proj.weight", (fs, d))]
    mtp = [_deepseek_mtp(m, k, moe) for k in range(1, m.mtp_num_layers + 1)]
    return Layout(model, moe, "model.layers.{i}.", 1, m.num_decoder_layers, m.first_num_dense_layers, dense, mtp)


def _deepseek_mtp(m: ModelConfig, k: int, block: list[Rule]) -> list[Rule]:
    """Depth k's tensors in DeepSeek-V3's layout: a decoder layer (`block`'s rules) with enorm,
    hnorm, eh_proj ([D, 2D]: the embedding's inputs, then the hidden state's) and shared_head.norm;
    its copies of the embedding and the output layer (shared in Tessera) are written on export and
    not read on import."""
    d, ours = m.emb_dim, f"mtp_{k}/"
    moved = [Rule(tuple(ours + "block/" + o for o in r.ours), r.hf, r.to_ours, r.to_hf) for r in block]
    head = "token_embedder/table_vd" if m.logits_via_embedding else "logits_dense_dv"
    return moved + [
        same(ours + "embedding_norm/scale", "enorm.weight"),
        same(ours + "hidden_norm/scale", "hnorm.weight"),
        Rule((ours + "projection_ced",), ("eh_proj.weight",),
             lambda w: (np.ascontiguousarray(w.T).reshape(2, d, d),),
             lambda w: (np.ascontiguousarray(w.reshape(2 * d, d).T),)),
        same(ours + "output_norm/scale", "shared_head.norm.weight"),
        Rule(("token_embedder/table_vd",), ("embed_tokens.weight",), lambda t: (), lambda t: (t,)),
        Rule((head,), ("shared_head.head.weight",), lambda w: (),
             lambda w: (w if m.logits_via_embedding else np.ascontiguousarray(w.T),)),
    ]


def llama4(m: ModelConfig) -> Layout:
    """Llama 4's text model: the query and key dimensions reordered from its interleaved rotary pairs
    (in every layer: a NoPE layer's scores do not change when queries and keys are reordered alike),
    and per layer either experts (router, gate_up_proj [E, D, 2F] gate first, a shared expert) or a
    dense MLP."""
    from tessera.config.layers import llama4_moe

    check_hf_has(m, "llama4")
    d, n, k, h, e, f, fd = (m.emb_dim, m.num_query_heads, m.num_kv_heads, m.head_dim, m.num_experts,
                            m.expert_mlp_dim, m.mlp_dim)
    model = [same("token_embedder/table_vd", "model.embed_tokens.weight"), same("final_norm/scale", "model.norm.weight")]
    if not m.logits_via_embedding:
        model.append(linear("logits_dense_dv", "lm_head.weight", (d, m.vocab_size)))
    qkv = [_mla_linear("attention/wq_dnh", "self_attn.q_proj.weight", (d, n, h), h),
           _mla_linear("attention/wk_dkh", "self_attn.k_proj.weight", (d, k, h), h),
           linear("attention/wv_dkh", "self_attn.v_proj.weight", (d, k, h))]
    common = qkv_rules(m, qkv, "attention/wqkv_dcnh", 1) + [
        linear_out("attention/wo_nhd", "self_attn.o_proj.weight", (n, h, d)),
        same("pre_attention_norm/scale", "input_layernorm.weight"),
        same("pre_mlp_norm/scale", "post_attention_layernorm.weight"),
    ]
    halves = Rule(("mlp/wi_0", "mlp/wi_1"), ("feed_forward.experts.gate_up_proj",),
                  lambda w: (np.ascontiguousarray(w[..., :f]), np.ascontiguousarray(w[..., f:])),
                  lambda a, b: (np.concatenate([a, b], axis=-1),))
    moe = common + [
        linear("mlp/router_de", "feed_forward.router.weight", (d, e)), halves,
        same("mlp/wo_efd", "feed_forward.experts.down_proj"),
        linear("mlp/shared/wi_0", "feed_forward.shared_expert.gate_proj.weight", (d, f)),
        linear("mlp/shared/wi_1", "feed_forward.shared_expert.up_proj.weight", (d, f)),
        linear("mlp/shared/wo_fd", "feed_forward.shared_expert.down_proj.weight", (f, d)),
    ]
    dense = common + [linear("mlp/wi_0", "feed_forward.gate_proj.weight", (d, fd)),
                      linear("mlp/wi_1", "feed_forward.up_proj.weight", (d, fd)),
                      linear("mlp/wo_fd", "feed_forward.down_proj.weight", (fd, d))]
    return Layout(model, moe, "model.layers.{i}.", LAYERS_PER_BLOCK["llama4"], m.num_decoder_layers,
                  rules_of_layer=lambda i: moe if llama4_moe(m, i) else dense)


def _grouped_split(ours: tuple[str, ...], hf: str, m: ModelConfig, shapes: tuple[tuple[int, ...], ...]) -> Rule:
    """A torch Linear [out, D] whose outputs are grouped per key head (Qwen3-Next's in_proj_qkvz and
    in_proj_ba: for each key head its part of each of ours in turn) <-> ours, [D, *shape] each, whose
    heads are numbered key head first (key head i's value heads are i * r ... (i + 1) * r - 1)."""
    d, kh = m.emb_dim, m.gdn_num_key_heads
    bounds = np.cumsum([0] + [int(np.prod(shape)) // kh for shape in shapes])

    def split(w):
        grouped = np.ascontiguousarray(w.T).reshape(d, kh, -1)
        return tuple(np.ascontiguousarray(grouped[:, :, a:b].reshape(d, *shape))
                     for a, b, shape in zip(bounds[:-1], bounds[1:], shapes))

    def join(*ps):
        grouped = np.concatenate([p.reshape(d, kh, -1) for p in ps], axis=-1)
        return (np.ascontiguousarray(grouped.reshape(d, -1).T),)

    return Rule(ours, (hf,), split, join)


def qwen3_next(m: ModelConfig) -> Layout:
    """Qwen3-Next: Gated DeltaNet layers (q, k, v and z projected together and b, a together, grouped per key
    head; one depthwise convolution kernel over the q, k and v channels) and gated attention layers (the query
    projection holds each head's query, then its gate), 3 : 1; experts with a gated shared expert in every layer."""
    d, n, k, h, f = m.emb_dim, m.num_query_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
    kh, vh, dk, dv, width = (m.gdn_num_key_heads, m.gdn_num_value_heads, m.gdn_key_head_dim, m.gdn_value_head_dim,
                             m.gdn_conv_kernel_dim)
    check_hf_has(m, "qwen3_next")
    model = [same("token_embedder/table_vd", "model.embed_tokens.weight"), same("final_norm/scale", "model.norm.weight")]
    if not m.logits_via_embedding:
        model.append(linear("logits_dense_dv", "lm_head.weight", (d, m.vocab_size)))
    channels = (kh * dk, kh * dk, vh * dv)
    conv_shapes = ((kh, dk), (kh, dk), (vh, dv))

    def conv_split(w):  # [channels, 1, W] -> three [W, heads, dim]
        w = w[:, 0, :]
        bounds = np.cumsum((0,) + channels)
        return tuple(np.ascontiguousarray(w[a:b].T).reshape(width, *shape)
                     for a, b, shape in zip(bounds[:-1], bounds[1:], conv_shapes))

    def conv_join(*ws):
        return (np.ascontiguousarray(np.concatenate([w.reshape(width, -1).T for w in ws])[:, None, :]),)

    gdn = "linear_attention/"
    linear_mixer = [
        _grouped_split(tuple(gdn + p for p in ("wq_dkh", "wk_dkh", "wv_dvh", "wz_dvh")), "linear_attn.in_proj_qkvz.weight",
                       m, ((kh, dk), (kh, dk), (vh, dv), (vh, dv))),
        _grouped_split((gdn + "wb_dv", gdn + "wa_dv"), "linear_attn.in_proj_ba.weight", m, ((vh,), (vh,))),
        Rule((gdn + "conv_q_wkh", gdn + "conv_k_wkh", gdn + "conv_v_wvh"), ("linear_attn.conv1d.weight",),
             conv_split, conv_join),
        same(gdn + "a_log_v", "linear_attn.A_log"), same(gdn + "dt_bias_v", "linear_attn.dt_bias"),
        same(gdn + "norm_scale_h", "linear_attn.norm.weight"),
        linear_out(gdn + "wo_vhd", "linear_attn.out_proj.weight", (vh, dv, d)),
    ]

    def query_and_gate(w):  # [N * 2H, D]: per head its query, then its gate
        both = np.ascontiguousarray(w.T).reshape(d, n, 2, h)
        return np.ascontiguousarray(both[:, :, 0]), np.ascontiguousarray(both[:, :, 1])

    attention = [
        Rule(("attention/wq_dnh", "attention/wgate_dnh"), ("self_attn.q_proj.weight",), query_and_gate,
             lambda q, g: (np.ascontiguousarray(np.stack([q, g], axis=2).reshape(d, -1).T),)),
        linear("attention/wk_dkh", "self_attn.k_proj.weight", (d, k, h)),
        linear("attention/wv_dkh", "self_attn.v_proj.weight", (d, k, h)),
        linear_out("attention/wo_nhd", "self_attn.o_proj.weight", (n, h, d)),
        same("attention/query_norm/scale", "self_attn.q_norm.weight"),
        same("attention/key_norm/scale", "self_attn.k_norm.weight"),
    ]
    fs = m.shared_experts * f
    mlp = [linear("mlp/router_de", "mlp.gate.weight", (d, m.num_experts)),
           experts("mlp/wi_0", "mlp.experts.{e}.gate_proj.weight", m, (d, f)),
           experts("mlp/wi_1", "mlp.experts.{e}.up_proj.weight", m, (d, f)),
           experts("mlp/wo_efd", "mlp.experts.{e}.down_proj.weight", m, (f, d)),
           linear("mlp/shared/wi_0", "mlp.shared_expert.gate_proj.weight", (d, fs)),
           linear("mlp/shared/wi_1", "mlp.shared_expert.up_proj.weight", (d, fs)),
           linear("mlp/shared/wo_fd", "mlp.shared_expert.down_proj.weight", (fs, d)),
           linear("mlp/shared_gate_d", "mlp.shared_expert_gate.weight", (d,))]
    common = [same("pre_attention_norm/scale", "input_layernorm.weight"),
              same("pre_mlp_norm/scale", "post_attention_layernorm.weight")] + mlp
    pattern = LAYERS_PER_BLOCK["qwen3_next"]
    return Layout(model, attention + common, "model.layers.{i}.", pattern, m.num_decoder_layers,
                  rules_of_layer=lambda i: attention + common if (i + 1) % pattern == 0 else linear_mixer + common)
