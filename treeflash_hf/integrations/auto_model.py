"""`AutoModel.from_pretrained` of a published drafter (z-lab DFlash, the TreeFlash authors' release, SpecForge or
speculators exports in their layouts) returns a `TreeFlashDrafterModel`: their config is a `qwen3` config, from
which transformers alone would build a bare Qwen3Model. transformers has no registration for a config that is another
model type's plus extra keys, so this wraps `AutoModel.from_pretrained` (the package's one patch of it, installed by
`import treeflash_hf`, idempotent); `trust_remote_code=True` (the publisher's own code) or an explicit `config=` keep
transformers' own path."""

from __future__ import annotations

import functools

from ..modeling.modeling_treeflash_drafter import TreeFlashDrafterModel


def install_auto_model_hook() -> None:
    """`AutoModel.from_pretrained` loads a published DFlash / TreeFlash-release drafter as a `TreeFlashDrafterModel`
    (transformers itself would build a bare Qwen3Model from its `qwen3` config). `trust_remote_code=True` or an
    explicit `config=` keep transformers' own path. Idempotent."""
    from transformers import AutoModel

    if getattr(AutoModel.from_pretrained, "_treeflash_published", False):
        return
    original = AutoModel.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if cls is AutoModel and not kwargs.get("trust_remote_code") and kwargs.get("config") is None:
            try:
                layout = TreeFlashDrafterModel._published_layout(pretrained_model_name_or_path, kwargs)
            except Exception:  # not readable here: transformers' own path reports it
                layout = None
            if layout is not None:
                return TreeFlashDrafterModel.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    from_pretrained._treeflash_published = True
    AutoModel.from_pretrained = classmethod(from_pretrained)
