"""Multi-token prediction (`mtp_num_layers`, `mtp_loss_scaling_factor`; DeepSeek-V3 §2.2).

Depth k = 1..D adds one block after the decoder. At position i it takes the previous depth's
hidden state h^{k-1}_i (depth 0: the decoder's last block output, before the final norm) and
the embedding of the input token k places ahead, t_{i+k}; each is normalized, the two are
projected back to emb_dim ([embedding; hidden] times a [2, D, D] weight, the order of
DeepSeek-V3's `eh_proj`), and the family's block (attention and MLP, experts included) turns
the result into h^k_i. Its own output norm and the model's output layer (shared, like the
embedding) predict t_{i+k+1}: with k = 1, the token after the next one. The chain stays
causal: h^k_i has seen only the tokens up to t_{i+k}.

The training loss adds mtp_loss_scaling_factor times the mean over depths of each depth's
mean cross-entropy; the `loss` metric stays the next-token loss (comparable with runs without
MTP) and `mtp_loss` reports the unscaled MTP mean. A position counts at depth k only when the
k + 1 targets after it are in its own document (packed rows) and none is padding: a
prediction never crosses a document boundary. Evaluation reports the MTP loss and, with
mtp_eval_target_module, a depth's acceptance rate (`tessera.evaluation`); decoding uses the main
model alone.

Where it differs from DeepSeek-V3's report: the hidden state given to depth 1 is the decoder's
output before its final norm (the report does not say; depth 1's `hidden_norm` normalizes it
either way). A MoE block's router statistics join the model's: its load-balancing loss is
added with load_balance_loss_weight, and with routed_bias its bias moves like the decoder's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tessera.config import ModelConfig
from tessera.mesh import shard_logically
from tessera.models.blocks import make_norm
from tessera.models.layers import fan_in_std, param, project


class MtpLayer(nnx.Module):
    """One prediction depth: norms of the embedding and the hidden state, their projection,
    a block of the model's family and the depth's output norm (before the shared output layer)."""

    def __init__(self, cfg: ModelConfig, block_cls: type, attention_kernel: str, rngs: nnx.Rngs):
        self.embedding_norm = make_norm(block_cls.norm, cfg, rngs)
        self.hidden_norm = make_norm(block_cls.norm, cfg, rngs)
        # [embedding, hidden] x [D in, D out]: the input dimension split over fsdp like every embed axis
        self.projection_ced = param(rngs, (2, cfg.emb_dim, cfg.emb_dim), (None, "embed", None), cfg.weight_dtype,
                                    fan_in_std(2 * cfg.emb_dim))
        self.block = block_cls(cfg, attention_kernel, rngs)
        self.output_norm = make_norm(block_cls.norm, cfg, rngs)
        self.dtype = cfg.dtype

    def __call__(self, hidden_btd, embedded_btd, positions_bt, segment_ids_bt, dropout_key, packed: bool):
        """(h^k [B, T, D], the block's aux) from h^{k-1} and the embeddings of the tokens k places ahead."""
        w = self.projection_ced[...].astype(self.dtype)
        # two products summed, not one over the pair stacked: each is a plain [B, T, D] x [D, D]
        # projection, which XLA shards as every other (the stacked pair, with the sequence split,
        # made it replicate the activations)
        x = project("btd,de->bte", self.embedding_norm(embedded_btd), w[0]) + \
            project("btd,de->bte", self.hidden_norm(hidden_btd), w[1])
        x = shard_logically(x, ("batch", "length", "act_embed"))
        x, aux, _ = self.block(x, positions_bt, segment_ids_bt, dropout_key, packed, None)
        return x, aux


def shift_left(a_bt, k: int):
    """a[:, k:] followed by k zeros along the length axis (position i holds a[:, i + k])."""
    if k == 0:
        return a_bt
    pad = [(0, 0)] * a_bt.ndim
    pad[1] = (0, k)
    return jnp.pad(a_bt[:, k:], pad)


def chain_weights(weights_bt, depth: int):
    """Which positions count at `depth`: the main loss's weights (the target is not padding and is
    in the input's document) of the position and the `depth` positions after it, all true."""
    ok = weights_bt
    for k in range(1, depth + 1):
        ok = ok & shift_left(weights_bt, k)
    return ok


def dropout_key_for(dropout_key, depth: int):
    """The dropout key of MTP depth `depth` (None when dropout is off)."""
    return None if dropout_key is None else jax.random.fold_in(dropout_key, 1_000_003 + depth)
