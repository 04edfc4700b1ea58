"""`decoder_block` -> block family. Adding a family: a module with its block class (see
`tessera.models.blocks.Block`), an entry here and in `tessera.config.fields.DECODER_BLOCKS`,
and model files under configs/models/."""

from __future__ import annotations

from tessera.models.blocks import Block
from tessera.models.deepseek import DeepseekBlock
from tessera.models.gemma import Gemma2Block, Gemma3Block, GemmaBlock
from tessera.models.gpt3 import Gpt3Block
from tessera.models.gpt_oss import GptOssBlock
from tessera.models.llama import LlamaBlock, MistralBlock
from tessera.models.llama4 import Llama4Block
from tessera.models.mixtral import MixtralBlock
from tessera.models.olmo3 import Olmo2Block, Olmo3Block
from tessera.models.qwen2 import Qwen2Block
from tessera.models.qwen3 import Qwen3Block, Qwen3MoeBlock
from tessera.models.qwen3_next import Qwen3NextBlock

BLOCKS: dict[str, type[Block]] = {
    "llama2": LlamaBlock,
    "mistral": MistralBlock,
    "mixtral": MixtralBlock,
    "gemma": GemmaBlock,
    "gemma2": Gemma2Block,
    "gpt3": Gpt3Block,
    "qwen2": Qwen2Block,
    "qwen3": Qwen3Block,
    "qwen3_moe": Qwen3MoeBlock,
    "gemma3": Gemma3Block,
    "deepseek": DeepseekBlock,
    "gpt_oss": GptOssBlock,
    "llama4": Llama4Block,
    "olmo3": Olmo3Block,
    "olmo2": Olmo2Block,
    "qwen3_next": Qwen3NextBlock,
}
