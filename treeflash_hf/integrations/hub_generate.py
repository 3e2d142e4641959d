"""`custom_generate/generate.py` of a published drafter repo: TreeFlash decoding without installing treeflash-hf.

    drafter = AutoModel.from_pretrained(REPO, trust_remote_code=True)
    out = target.generate(**inputs, assistant_model=drafter, custom_generate=REPO, trust_remote_code=True)

`treeflash-hf push` copies this file and the engine modules it imports (relative imports) into the repo, so the
Hub copy is the installed engine, file for file.
"""

from transformers.generation import GenerationMixin

from .generate_hook import route_generate


def generate(model, *args, **kwargs):
    """Called by transformers with `model` = the target and the arguments given to `target.generate()`."""
    kwargs.pop("custom_generate", None)
    return route_generate(GenerationMixin.generate, model, *args, **kwargs)
