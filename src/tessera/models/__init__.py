"""Decoder models. `ModelDef` is the functional face of an NNX model used by the trainer:
parameters are a plain nested dict of arrays, initialized and applied by pure functions."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx

from tessera.config import ModelConfig
from tessera.config.derived import PipelineLayout
from tessera.config.checks import validate_for_build
from tessera.models.decoder import Decoder, init_cache  # noqa: F401
from tessera.models.precision import matmul_precision
from tessera.models.remat import OFFLOADING_POLICIES, REMAT_POLICIES, offloads_to_host  # noqa: F401
from tessera.models.registry import BLOCKS

__all__ = ["BLOCKS", "ModelDef", "OFFLOADING_POLICIES", "REMAT_POLICIES", "build_model", "matmul_precision",
           "offloads_to_host"]


def _in_matmul_precision(method):
    """`method` traced in `matmul_precision(self.cfg)`."""
    @functools.wraps(method)
    def traced(self, *args, **kwargs):
        with matmul_precision(self.cfg):
            return method(self, *args, **kwargs)
    return traced


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static argument of jitted functions
class ModelDef:
    """A model's structure without its weights: `init` makes parameters, `apply` runs them."""

    cfg: ModelConfig
    attention_kernel: str
    graphdef: Any
    abstract_state: Any  # nnx.State of ShapeDtypeStructs, with sharding_names metadata
    pipeline: PipelineLayout | None = None  # blocks split over the stage mesh axis (tessera.models.pipeline)

    def init(self, key: jax.Array) -> dict:
        """Fresh parameters as a nested dict of arrays (call under jit to create them sharded)."""
        model = Decoder(self.cfg, self.attention_kernel, nnx.Rngs(params=key), self.pipeline)
        return nnx.to_pure_dict(nnx.state(model))

    @_in_matmul_precision
    def apply(self, params: dict, tokens_bt, positions_bt=None, segment_ids_bt=None, dropout_key=None,
              packed: bool = False, kv_cache=None):
        """Logits [B, T, V] in float32 for `tokens_bt` [B, T]. Decoding passes `kv_cache` (from
        `init_cache`) and gets (logits, updated kv_cache): first the (left-padded, segment id 0)
        prompt, then one token per call (see `Decoder.__call__`)."""
        if kv_cache is None:
            return self.apply_with_aux(params, tokens_bt, positions_bt, segment_ids_bt, dropout_key, packed)[0]
        return self._module(params)(tokens_bt, positions_bt, segment_ids_bt, dropout_key, packed, kv_cache)

    @_in_matmul_precision
    def next_logits(self, params: dict, tokens_bt, positions_bt, segment_ids_bt, kv_cache):
        """(logits [B, V] float32 of each row's last token, updated kv_cache): a decoding call that
        needs only the next token's distribution, so the output layer runs on the last position
        alone (a prompt's logits for every position would be [B, T, V]: 128 GiB for Gemma 3's
        262k vocabulary and a 128k-token prompt)."""
        module = self._module(params)
        x, _, kv_cache = module.hidden(tokens_bt, positions_bt, segment_ids_bt, None, False, kv_cache)
        return module.logits(x[:, -1:])[:, 0], kv_cache

    @_in_matmul_precision
    def apply_with_aux(self, params: dict, tokens_bt, positions_bt=None, segment_ids_bt=None, dropout_key=None,
                       packed: bool = False):
        """(logits, aux): aux holds the layer-averaged auxiliary scalars (MoE losses; {} for dense models)."""
        return self._module(params)(tokens_bt, positions_bt, segment_ids_bt, dropout_key, packed)

    @_in_matmul_precision
    def hidden_with_aux(self, params: dict, tokens_bt, positions_bt=None, segment_ids_bt=None, dropout_key=None,
                        packed: bool = False):
        """(x [B, T, D], aux): the last block's output, before the final norm and `logits`."""
        return self._module(params).hidden(tokens_bt, positions_bt, segment_ids_bt, dropout_key, packed)[:2]

    @_in_matmul_precision
    def logits(self, params: dict, x_btd, mtp_depth: int = 0):
        """Final norm and output projection of `hidden_with_aux`'s x: [B, T, D] -> [B, T, V] float32
        (`mtp_depth` k > 0: of `mtp_hidden`'s h^k, through that depth's own output norm)."""
        return self._module(params).logits(x_btd, mtp_depth)

    @_in_matmul_precision
    def mtp_hidden(self, params: dict, x_btd, tokens_bt, positions_bt=None, segment_ids_bt=None, dropout_key=None,
                   packed: bool = False):
        """([h^1 .. h^D], aux): the multi-token-prediction depths on `hidden_with_aux`'s x for the
        same input tokens (`Decoder.mtp_hidden`; mtp_num_layers > 0)."""
        return self._module(params).mtp_hidden(x_btd, tokens_bt, positions_bt, segment_ids_bt, dropout_key, packed)

    def init_cache(self, batch: int, max_len: int):
        """An empty KV cache for decoding `batch` rows of up to `max_len` tokens (prompt included)."""
        return init_cache(self.cfg, batch, max_len)

    def _module(self, params: dict):
        state = jax.tree.map(lambda x: x, self.abstract_state)  # a fresh State to fill
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def param_shapes(self) -> dict:
        """Nested dict of ShapeDtypeStruct, the same structure as `init`'s result."""
        return nnx.to_pure_dict(self.abstract_state)

    def logical_axes(self) -> dict:
        """Nested dict of logical axis-name tuples, one per parameter."""
        specs = nnx.to_pure_dict(nnx.get_partition_spec(self.abstract_state))
        return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def build_model(cfg: ModelConfig, attention_kernel: str = "dot_product", pipeline: PipelineLayout | None = None
                ) -> ModelDef:
    """The structure of the model `cfg` describes; no parameter memory is allocated. `pipeline`
    (from the run plan of a mesh with a stage axis) splits the blocks over the stages."""
    validate_for_build(cfg)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, attention_kernel, nnx.Rngs(params=0), pipeline))
    graphdef, state = nnx.split(abstract)
    return ModelDef(cfg, attention_kernel, graphdef, state, pipeline)
