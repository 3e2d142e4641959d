"""treeflash-hf: TreeFlash speculative decoding for Hugging Face transformers.

`import treeflash_hf` registers the drafter with the Auto classes and routes
`target.generate(**inputs, assistant_model=drafter)` to lossless TreeFlash decoding.
"""

import logging

import torch

# torchao (the `quant` extra), which transformers imports with its quantizers, logs a warning for each CUDA kernel
# library it cannot load (nothing to say on a machine without CUDA) and, through torch, one for each Enum it registers
# the pre-2.13 way: noise that would open every command's output
if not torch.cuda.is_available():
    logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Failed to load"))
logging.getLogger("torch.utils._pytree").addFilter(
    lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage())

from transformers import AutoConfig, AutoModel  # noqa: E402

from .engine.answer_store import AnswerStore, attach_answer_store
from .engine.decode import TreeFlashGenerateOutput, TreeFlashStats, treeflash_decode, treeflash_generate
from .engine.draft import BlockDraft, TreeDrafter
from .engine.learned import forget_learned_state
from .engine.options import TreeOptions
from .engine.tree import DraftTree
from .engine.validation import TreeFlashInputError
from .integrations.auto_model import install_auto_model_hook
from .integrations.candidate_generator import TreeFlashCandidateGenerator
from .integrations.generate_hook import install_generate_hook
from .modeling.configuration_treeflash_drafter import TreeFlashDrafterConfig
from .modeling.modeling_treeflash_drafter import TreeFlashDrafterModel

__version__ = "0.1.0"

AutoConfig.register(TreeFlashDrafterConfig.model_type, TreeFlashDrafterConfig, exist_ok=True)
AutoModel.register(TreeFlashDrafterConfig, TreeFlashDrafterModel, exist_ok=True)
TreeFlashDrafterConfig.register_for_auto_class()
TreeFlashDrafterModel.register_for_auto_class("AutoModel")
install_generate_hook()
install_auto_model_hook()  # AutoModel.from_pretrained(<z-lab DFlash or TreeFlash-release drafter>) -> our drafter

__all__ = [
    "AnswerStore",
    "BlockDraft",
    "DraftTree",
    "TreeDrafter",
    "TreeFlashCandidateGenerator",
    "TreeFlashDrafterConfig",
    "TreeFlashDrafterModel",
    "TreeFlashGenerateOutput",
    "TreeFlashInputError",
    "TreeFlashStats",
    "TreeOptions",
    "attach_answer_store",
    "forget_learned_state",
    "treeflash_decode",
    "treeflash_generate",
]
