"""The decoder-only language model: embedding, a stack of blocks, final norm, logits.

The block family (`decoder_block`, see `tessera.models.registry`) decides the block and,
through its class attributes, the final norm, whether embeddings are scaled and whether
positions are added to them.

With `scan_layers=true` the blocks' parameters are stacked on a leading `layers` axis and run
with `jax.lax.scan` (one compiled block, fast compiles); with `false` they are separate
modules `layers_0 ... layers_{L-1}` run in a Python loop. Both compute the same function on
the same weights (stacked along axis 0 or split; `tessera.tools.convert` writes either layout).

`remat_policy` maps to a `jax.checkpoint` policy applied around each block
(`tessera.models.remat`). A block's input is named decoder_layer_input for those keys.

With a `PipelineLayout` (a mesh with a `stage` axis) the blocks are always stacked, split
over the stages and run by `tessera.models.pipeline` (scan_layers then decides whether a stage
scans its layers or unrolls them); with more than one repeat their leading axes are [R, L/R].

Decoding passes a KV cache (`init_cache`, `tessera.models.kv_cache`) to the same call: each
block gets its own cache, hands it to its attention and returns it updated; the decoder
returns the new cache in place of `aux`. With scanned layers the caches are stacked like the
parameters and travel in the scan's carry, each layer updating its part in place (as scanned
inputs and outputs they would be copied whole in every call). Training passes none, and its
program holds no cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tessera.config import ModelConfig
from tessera.config.derived import PipelineLayout, dropout_rate
from tessera.mesh import shard_logically
from tessera.models.blocks import make_norm
from tessera.models.kv_cache import KVCache
from tessera.models.layers import Embed, dropout, fan_in_std, param, project, sinusoidal_positions, soft_cap
from tessera.models.moe_balance import PER_LAYER_LOAD, finish_aux
from tessera.models.mtp import MtpLayer, dropout_key_for, shift_left
from tessera.models.pipeline import PER_LAYER, block_weights, group_weights, run_pipeline, stacked_shape, stage_specs
from tessera.models.registry import BLOCKS
from tessera.models.remat import remat

# aux key of the MTP depths' expert loads [D, E] (routed_bias): the train step moves their biases with it
MTP_LOAD = "per_layer/mtp_expert_load"


class Decoder(nnx.Module):
    """Token ids [B, T] -> (logits [B, T, V] float32, aux): aux holds the blocks' auxiliary
    scalars (mixture-of-experts losses) averaged over blocks; empty for dense families.
    With `kv_cache`: (logits, updated kv_cache) instead (see `__call__`)."""

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs, pipeline: PipelineLayout | None = None):
        dtype, wdtype = cfg.dtype, cfg.weight_dtype
        block_cls = BLOCKS[cfg.decoder_block]
        prefix, prefix_cls = block_cls.prefix_blocks(cfg)
        self.num_blocks, tail = divmod(cfg.num_decoder_layers - prefix, block_cls.layers_per_block)
        if prefix:  # deepseek: the dense layers below the expert layers, a stack (or list) of their own
            if cfg.scan_layers or pipeline is not None:
                self.dense_layers = _stacked_blocks(lambda r: prefix_cls(cfg, attention_kernel, r), prefix, rngs)
            else:
                for i, block in enumerate(_unstacked_blocks(lambda r: prefix_cls(cfg, attention_kernel, r), prefix, rngs)):
                    setattr(self, f"dense_layers_{i}", block)
        if tail:  # gemma3, olmo3: the layers after the last whole pattern (validated: no other family has one)
            self.tail = block_cls(cfg, attention_kernel, rngs, num_layers=tail)
        self.prefix_blocks, self.tail_layers = prefix, tail
        self.token_embedder = Embed(cfg.vocab_size, cfg.emb_dim, dtype, wdtype, cfg.use_iota_embed, rngs)
        if block_cls.absolute_positions and cfg.trainable_position_size:
            self.position_embedder_pd = param(rngs, (cfg.trainable_position_size, cfg.emb_dim), (None, "embed"),
                                              wdtype, fan_in_std(cfg.emb_dim))
        if cfg.scan_layers or pipeline is not None:
            self.layers = _stacked_blocks(lambda r: block_cls(cfg, attention_kernel, r), self.num_blocks, rngs)
            lead = stacked_shape(pipeline, self.num_blocks)
            if len(lead) > 1:  # circular pipelining: [L, ...] -> [R, L/R, ...], the same order flattened
                for _, var in nnx.iter_graph(self.layers):
                    if isinstance(var, nnx.Param):
                        var.set_value(var.get_value().reshape(*lead, *var.get_value().shape[1:]))
                        var.set_metadata(out_sharding=("pipeline_repeats", *var.get_metadata()["out_sharding"]))
        else:
            for i, block in enumerate(_unstacked_blocks(lambda r: block_cls(cfg, attention_kernel, r), self.num_blocks,
                                                        rngs)):
                setattr(self, f"layers_{i}", block)
        self.final_norm = make_norm(block_cls.norm, cfg, rngs)
        if not cfg.logits_via_embedding:
            self.logits_dense_dv = param(rngs, (cfg.emb_dim, cfg.vocab_size), ("embed", "vocab"), wdtype,
                                         fan_in_std(cfg.emb_dim))
        # multi-token prediction depths (tessera.models.mtp), initialized last: the rest of the
        # model draws the same initial weights with or without them
        for k in range(1, cfg.mtp_num_layers + 1):
            setattr(self, f"mtp_{k}", MtpLayer(cfg, block_cls, attention_kernel, rngs))
        self.cfg, self.block_cls, self.pipeline = cfg, block_cls, pipeline

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, dropout_key=None, packed=False,
                 kv_cache=None):
        """(logits, aux) for tokens [B, T] at positions [B, T] (default 0..T-1) in segments [B, T]
        (default all 1). Decoding passes `kv_cache` (from `init_cache`) and gets (logits, updated
        kv_cache): the T tokens of each row attend over the cache and are added to it; segment id
        0 marks left padding, and positions continue each row's count (the prompt, then one token
        per call). Decoding runs without dropout or rematerialization."""
        x, aux, kv_cache = self.hidden(tokens_bt, positions_bt, segment_ids_bt, dropout_key, packed, kv_cache)
        return (self.logits(x), aux) if kv_cache is None else (self.logits(x), kv_cache)

    def hidden(self, tokens_bt, positions_bt=None, segment_ids_bt=None, dropout_key=None, packed=False,
               kv_cache=None):
        """(x [B, T, D] before the final norm, aux, kv_cache): `__call__` without the logits."""
        cfg = self.cfg
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones_like(tokens_bt)
        rate = dropout_rate(cfg)
        n, p = self.num_blocks, self.prefix_blocks
        keys = [None] * (p + n + 2)  # dense prefix, blocks, tail, embedding
        if dropout_key is not None and rate > 0:
            keys = list(jax.random.split(dropout_key, p + n + 2))

        x = shard_logically(dropout(self.embed(tokens_bt, positions_bt), rate, keys[-1]),
                            ("batch", "length", "act_embed"))
        if self.pipeline is not None:
            blocks = self._pipeline_blocks if kv_cache is None else self._scan_blocks
        else:
            blocks = self._scan_blocks if cfg.scan_layers else self._loop_blocks
        if not p and not self.tail_layers:
            x, aux, caches = blocks(x, positions_bt, segment_ids_bt, keys[:n], packed, kv_cache)
            return x, finish_aux(aux, cfg), caches
        # a dense prefix (deepseek) or a tail block (gemma3, olmo3): the cache is {segment: its caches};
        # both are dense (no aux)
        caches = {} if kv_cache is None else dict(kv_cache)
        if p:
            run = self._scan_blocks if cfg.scan_layers or self.pipeline is not None else self._loop_blocks
            x, _, caches["dense_layers"] = run(x, positions_bt, segment_ids_bt, keys[:p], packed,
                                               caches.get("dense_layers"), "dense_layers", p)
        x, aux, caches["layers"] = blocks(x, positions_bt, segment_ids_bt, keys[p:p + n], packed, caches.get("layers"))
        if self.tail_layers:
            run_cfg = cfg if kv_cache is None else dataclasses.replace(cfg, remat_policy="none")
            call = remat(lambda blk, h, k, c: blk(checkpoint_name(h, "decoder_layer_input"), positions_bt,
                                                  segment_ids_bt, k, packed, c), run_cfg, False)
            x, _, caches["tail"] = call(self.tail, x, keys[-2], caches.get("tail"))
        return x, finish_aux(aux, cfg), None if kv_cache is None else caches

    def mtp_hidden(self, x_btd, tokens_bt, positions_bt, segment_ids_bt, dropout_key=None, packed=False):
        """([h^1, ..., h^D] each [B, T, D], aux): the multi-token-prediction depths
        (`tessera.models.mtp`) run on `hidden`'s x for the input tokens [B, T]; position i of h^k
        predicts the target k places after position i's own. aux: the depths' MoE statistics,
        as "mtp_..." entries (the expert loads as MTP_LOAD [D, E] with routed_bias)."""
        cfg = self.cfg
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones_like(tokens_bt)
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        rate = dropout_rate(cfg)
        hiddens, auxes, h = [], [], x_btd
        # the input embeddings once, shifted k places for depth k (the embedding of t_{i+k} at position
        # i; the k positions past the end get zeros, and count in no loss). Gathering the shifted ids
        # again made XLA gather every row's embeddings on every device when the sequence is split.
        embedded = shard_logically(self.embed(tokens_bt, positions_bt), ("batch", "length", "act_embed"))
        for k in range(1, cfg.mtp_num_layers + 1):
            ahead = shard_logically(shift_left(embedded, k), ("batch", "length", "act_embed"))
            key = dropout_key_for(dropout_key, k) if rate > 0 else None
            call = remat(lambda layer, h_, e_, key_: layer(checkpoint_name(h_, "decoder_layer_input"), e_,
                                                          positions_bt, segment_ids_bt, key_, packed), cfg, False)
            h, aux = call(getattr(self, f"mtp_{k}"), h, ahead, key)
            hiddens.append(h)
            auxes.append(aux)
        aux = finish_aux(reduce_aux(jax.tree.map(lambda *v: jnp.stack(v), *auxes)), cfg)
        return hiddens, {MTP_LOAD if k == PER_LAYER_LOAD else f"mtp_{k}": v for k, v in aux.items()}

    def logits(self, x_btd, mtp_depth: int = 0):
        """Final norm and output projection: [B, T, D] -> logits [B, T, V] float32 (the loss calls it
        on chunks of the tokens with num_vocab_tiling > 1). `mtp_depth` k > 0: for h^k of
        `mtp_hidden`, normalized by that depth's output norm instead of the final norm."""
        cfg = self.cfg
        x = getattr(self, f"mtp_{mtp_depth}").output_norm(x_btd) if mtp_depth else self.final_norm(x_btd)
        if cfg.logits_via_embedding:
            logits = self.token_embedder.attend(x, cfg.logits_dot_in_fp32)
        else:
            dtype = jnp.float32 if cfg.logits_dot_in_fp32 else cfg.dtype
            logits = project("btd,dv->btv", x.astype(dtype), self.logits_dense_dv[...].astype(dtype),
                             quantization=cfg.quantization if cfg.quantization == "fp8_full" else "")
        logits = soft_cap(logits.astype(jnp.float32), cfg.final_logits_soft_cap)
        return shard_logically(logits, ("batch", "length", "act_vocab"))

    def embed(self, tokens_bt, positions_bt):
        """Token embeddings, scaled (Gemma) or with position embeddings added (GPT-3)."""
        x = self.token_embedder(tokens_bt)
        if self.block_cls.scale_embeddings:
            x = x * jnp.asarray(self.cfg.emb_dim**0.5, x.dtype)
        if self.block_cls.absolute_positions:
            if self.cfg.trainable_position_size:
                x = x + jnp.take(self.position_embedder_pd[...].astype(x.dtype), positions_bt, axis=0)
            else:
                x = x + sinusoidal_positions(positions_bt, self.cfg.emb_dim).astype(x.dtype)
        return x

    def _loop_blocks(self, x, positions_bt, segment_ids_bt, keys, packed, kv_cache, name="layers", count=None):
        """(x, aux averaged over blocks, kv_cache as a tuple of the blocks' caches or None) of the
        blocks `<name>_0 ...`."""
        cfg = self.cfg if kv_cache is None else dataclasses.replace(self.cfg, remat_policy="none")
        auxes, caches = [], []
        for i in range(self.num_blocks if count is None else count):
            call = remat(lambda blk, h, k, c: blk(checkpoint_name(h, "decoder_layer_input"), positions_bt,
                                                  segment_ids_bt, k, packed, c), cfg, False)
            x, block_aux, block_cache = call(getattr(self, f"{name}_{i}"), x, keys[i],
                                             None if kv_cache is None else kv_cache[i])
            auxes.append(block_aux)
            caches.append(block_cache)
        aux = reduce_aux(jax.tree.map(lambda *v: jnp.stack(v), *auxes))
        return x, aux, None if kv_cache is None else tuple(caches)

    def _scan_blocks(self, x, positions_bt, segment_ids_bt, keys, packed, kv_cache, name="layers", count=None):
        """(x, aux averaged over blocks, kv_cache stacked over blocks or None): the blocks'
        parameters, dropout keys and caches are scanned over together (a pipelined model's
        [R, L/R] stack is flattened first: decoding runs its blocks one after another)."""
        count = self.num_blocks if count is None else count
        graphdef, stacked = nnx.split(getattr(self, name))
        lead = len(stacked_shape(self.pipeline, count)) if name == "layers" else 1
        stacked = jax.tree.map(lambda a: a.reshape(count, *a.shape[lead:]), stacked)
        use_keys = keys[0] is not None

        key_stack = jnp.stack(keys) if use_keys else jnp.zeros((len(keys),), jnp.uint32)

        def run(h, layer_state, key, layer_cache):
            block = nnx.merge(graphdef, layer_state)
            return block(checkpoint_name(h, "decoder_layer_input"), positions_bt, segment_ids_bt,
                         key if use_keys else None, packed, layer_cache)

        if kv_cache is None:
            def body(h, layer):
                h, aux, _ = run(h, *layer, None)
                return h, aux

            x, aux = jax.lax.scan(remat(body, self.cfg, True), x, (stacked, key_stack))
            return x, reduce_aux(aux), None
        # Decoding: the stacked caches are part of the loop's carry, and each layer writes its own
        # back in place. As scanned inputs and outputs they were a second copy of the whole cache
        # (and a zero-filled one) in every call's temporaries.
        empty = KVCache.is_empty(kv_cache)
        caches = KVCache.as_empty(kv_cache, empty=False)  # the carry's type stays the same

        def body(carry, layer):
            h, caches, i = carry
            mine = jax.tree.map(lambda c: jax.lax.dynamic_index_in_dim(c, i, keepdims=False), caches)
            h, aux, mine = run(h, *layer, KVCache.as_empty(mine) if empty else mine)
            caches = jax.tree.map(lambda c, m: jax.lax.dynamic_update_index_in_dim(c, m, i, 0), caches, mine)
            return (h, caches, i + 1), aux

        (x, caches, _), aux = jax.lax.scan(body, (x, caches, jnp.zeros((), jnp.int32)), (stacked, key_stack))
        return x, reduce_aux(aux), caches

    def _pipeline_blocks(self, x, positions_bt, segment_ids_bt, keys, packed, kv_cache):
        """(x, aux averaged over blocks and microbatches, None): the blocks run by the pipeline
        schedule over the `stage` mesh axis (`tessera.models.pipeline`); each stage runs its
        group of blocks scanned (scan_layers=true) or unrolled, under the remat policy. Without
        a mesh whose stage axis matches (a model applied outside the trainer), or for a batch
        the microbatches do not divide, the same blocks run one after another."""
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or dict(mesh.shape).get("stage", 1) != self.pipeline.stages \
                or x.shape[0] % self.pipeline.microbatches:  # (a batch the microbatches do not divide)
            return self._scan_blocks(x, positions_bt, segment_ids_bt, keys, packed, kv_cache)
        graphdef, stacked = nnx.split(self.layers)
        use_keys = keys[0] is not None
        cfg = self.cfg

        def one_block(h, layer_state, key, pos, seg):
            block = nnx.merge(graphdef, layer_state)
            h, aux, _ = block(checkpoint_name(h, "decoder_layer_input"), pos, seg, key if use_keys else None, packed,
                              None)
            return h, aux

        # A block takes its weights from the stage's [R, B, ...] (by the iteration's repeat) where it
        # runs, inside its remat region if any, so the backward pass takes them again. Taken outside,
        # as the unpipelined scan's inputs are, the pipeline's loop would keep a copy per iteration
        # (M*R + S - 1 of them; whole groups with pipeline_fsdp_ag_once) of weights that are a loop
        # invariant (AOT for v5e-4, emb 1024 x 8 layers, 2 stages x 2 repeats x fsdp 2, remat full:
        # 640 MiB of temporaries that way, 367 this way; 1323 -> 826 with pipeline_fsdp_ag_once). The
        # gradient goes back through the group's rows (`pipeline.group_weights`), so only the
        # pipeline's loop sums a stage-sized gradient (the same model: 367 -> 328 MiB), and with
        # pipeline_fsdp_ag_once it goes to the fsdp shares, not to the gathered copy (826 -> 375;
        # with remat_policy=none, whose blocks keep their weights per iteration anyway, 1565 -> 1102).
        def run_group(weights, repeat, h, pos, seg, group_keys):
            stage, sinks = group_weights(weights, repeat)

            def block(h_, layer, key):  # layer: (index in the group, the sinks' row)
                return one_block(h_, block_weights(stage, layer[1], repeat, layer[0]), key, pos, seg)

            per_block = (jnp.arange(self.pipeline.blocks_per_stage), sinks)
            if cfg.scan_layers:
                call = remat(block, cfg, True)
                h, aux = jax.lax.scan(lambda h_, xs: call(h_, *xs), h, (per_block, group_keys))
                return h, reduce_aux(aux)
            auxes = []
            for i in range(self.pipeline.blocks_per_stage):
                h, aux = remat(block, cfg, False)(h, jax.tree.map(lambda a: a[i], per_block), group_keys[i])
                auxes.append(aux)
            return h, reduce_aux(jax.tree.map(lambda *v: jnp.stack(v), *auxes))

        key_stack = jnp.stack(keys) if use_keys else jnp.zeros((len(keys),), jnp.uint32)
        specs = gathered = None
        if self.pipeline.gather_fsdp_once:
            names, sizes = nnx.get_partition_spec(stacked), dict(mesh.shape)
            specs, gathered = (stage_specs(self.pipeline, stacked, names, sizes, g) for g in (False, True))
        x, aux = run_pipeline(self.pipeline, run_group, stacked, key_stack, use_keys, x, positions_bt, segment_ids_bt,
                              specs, gathered)
        return x, aux, None


def reduce_aux(stacked: dict) -> dict:
    """Blocks' aux values stacked over blocks -> their means, except the per-layer entries
    ("per_layer/..."), which stay stacked (one row per block)."""
    return {k: v if k.startswith(PER_LAYER) else jnp.mean(v) for k, v in stacked.items()}


def init_cache(cfg: ModelConfig, batch: int, max_len: int):
    """An empty KV cache for `Decoder(cfg)` decoding `batch` rows of up to `max_len` tokens: one
    cache per block (`Block.empty_cache`), laid out as the parameters are: stacked on a leading
    layers axis when scan_layers=true, else a tuple with one entry per block; with a dense prefix
    (deepseek) or a tail block (gemma3, olmo3), a dict of those per segment ("dense_layers", "layers",
    "tail")."""
    block_cls = BLOCKS[cfg.decoder_block]
    prefix, prefix_cls = block_cls.prefix_blocks(cfg)
    num_blocks, tail = divmod(cfg.num_decoder_layers - prefix, block_cls.layers_per_block)

    def stack(cls, count):
        if cfg.scan_layers:
            return cls.empty_cache(cfg, batch, max_len, (count,))
        return tuple(cls.empty_cache(cfg, batch, max_len) for _ in range(count))

    if not prefix and not tail:
        return stack(block_cls, num_blocks)
    # a dense prefix (deepseek) or a tail block (the layers of gemma3 or olmo3 after the last whole pattern)
    caches = {"layers": stack(block_cls, num_blocks)}
    if prefix:
        caches["dense_layers"] = stack(prefix_cls, prefix)
    if tail:
        caches["tail"] = block_cls.empty_cache(cfg, batch, max_len, num_layers=tail)
    return caches


def _unstacked_blocks(make_block, num_layers: int, rngs: nnx.Rngs) -> list:
    """`num_layers` blocks drawn from the same keys as `_stacked_blocks` draws its stack's slices
    (one draw of each stream, split `num_layers` ways): scan_layers=false starts from the weights
    of scan_layers=true."""
    keys = {name: jax.random.split(stream(), num_layers) for name, stream in rngs.items()}
    return [make_block(nnx.Rngs(**{name: k[i] for name, k in keys.items()})) for i in range(num_layers)]


def _stacked_blocks(make_block, num_layers: int, rngs: nnx.Rngs):
    """`num_layers` independently initialized blocks with parameters stacked on axis 0."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r):
        return make_block(r)

    return make(rngs)
