"""The engine's lean target forward (`engine/lean_forward.py`): bit for bit the model's own forward, used inside the
engine's kernels only, and never where it does not cover a call or a model."""

import contextlib

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from treeflash_hf.engine import lean_forward as lean_module
from treeflash_hf.engine.attention import tree_attention
from treeflash_hf.engine.kernels import LEAN_FORWARD, engine_kernel_names, engine_kernels
from treeflash_hf.engine.onednn import fused_products, packable_dtypes
from treeflash_hf.engine.tree import TreeBatch, best_first_tree, table_children
from treeflash_hf.engine.verify import tree_attention_mask
from treeflash_hf.integrations.cpu_linear import pack_linears, unpack_linears
from treeflash_hf.recipes.testing import matching_drafter, random_target


def target_of(arch: str, dtype: torch.dtype):
    if arch in ("llama", "qwen3"):
        model = random_target(arch, vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2, seed=3)
    else:
        common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None)
        torch.manual_seed(3)
        model = (Qwen2ForCausalLM(Qwen2Config(**common)) if arch == "qwen2"
                 else MistralForCausalLM(MistralConfig(**common))).eval()
    return model.to(dtype)


@contextlib.contextmanager
def counted_lean_calls(monkeypatch):
    calls = []
    original = lean_module.lean_forward

    def counting(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape if "input_ids" in kwargs else args[2].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(lean_module, "lean_forward", counting)
    yield calls
    monkeypatch.setattr(lean_module, "lean_forward", original)


def forwards(model, lean: bool):
    """A prefill of two padded rows, one token, and a tree per row (asking for some hidden states and for all),
    on the engine's kernels with the lean forward on or off: the outputs, flattened."""
    prompt = torch.tensor([[5, 9, 2, 33, 17, 8], [0, 0, 4, 12, 40, 3]])
    padding = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    generator = torch.Generator().manual_seed(9)
    tokens, log_probs = torch.randint(0, 64, (4, 3), generator=generator), -torch.rand(4, 3, generator=generator)
    trees = TreeBatch.pack([best_first_tree(root, table_children(tokens, log_probs, lambda d, t: d), 9, 4)
                            for root in (7, 21)])
    cache = DynamicCache(config=model.config)
    outputs = []
    with torch.no_grad():
        for call in (dict(input_ids=prompt, attention_mask=padding, output_hidden_states=[0, 2, -1]),
                     dict(input_ids=torch.tensor([[3], [11]]), position_ids=torch.tensor([[6], [4]]),
                          attention_mask=torch.cat([padding, torch.ones(2, 1, dtype=torch.long)], 1),
                          output_hidden_states=True, logits_to_keep=1),
                     dict(input_ids=trees.tokens, position_ids=torch.tensor([7, 5])[:, None] + trees.depths,
                          attention_mask=tree_attention_mask(trees, torch.cat([padding, torch.ones(2, 1)], 1).bool(),
                                                             7, model.dtype), output_hidden_states=[1])):
            if lean:
                with engine_kernels(model):
                    out = model(**call, cache=cache, use_cache=True)
            else:
                with tree_attention(model), fused_products(model):
                    out = model(**call, cache=cache, use_cache=True)
            outputs.append(out.logits)
            outputs.extend(state if state is not None else torch.zeros(0) for state in out.hidden_states)
    return outputs


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_forward_is_the_models_forward_bit_for_bit(monkeypatch, arch, dtype):
    """Every logit and hidden state (padded rows, a prefill, one token, a tree; some and all hidden states) equals
    the model's own forward on the same kernels, with its linear layers stock and packed (the fused products read
    as views), and every call took the lean path."""
    if dtype == torch.bfloat16 and torch.bfloat16 not in packable_dtypes():
        pytest.skip("no bfloat16 arithmetic on this CPU")
    model = target_of(arch, dtype)
    for packed in (False, True):
        if packed:
            pack_linears(model)
        stock = forwards(model, lean=False)
        with counted_lean_calls(monkeypatch) as calls:
            lean = forwards(model, lean=True)
        assert sum(shape[0] == 2 for shape in calls) == 3, (arch, packed)  # (not counting the one-row probe's)
        assert len(stock) == len(lean) and all(torch.equal(a, b) for a, b in zip(stock, lean)), (arch, dtype, packed)
        assert "forward" not in model.__dict__  # outside the engine's kernels the model runs its own forward
    unpack_linears(model)


def test_the_lean_forward_covers_only_what_it_computes(monkeypatch):
    """A call with other arguments, a hook on a module it steps over, or a model whose own forward it does not
    reproduce (the probe) runs the model's own forward; the switch is undone on leaving (an exception included)."""
    model = target_of("llama", torch.float32)
    prompt = torch.tensor([[5, 9, 2, 33]])
    assert LEAN_FORWARD in engine_kernel_names(model)
    with counted_lean_calls(monkeypatch) as calls, torch.no_grad():
        with engine_kernels(model):
            expected = model(input_ids=prompt, cache=DynamicCache(config=model.config)).logits
            assert len(calls) == 1
            embeds = model.model.embed_tokens(prompt)
            assert torch.equal(model(inputs_embeds=embeds, cache=DynamicCache(config=model.config)).logits, expected)
            model(input_ids=prompt)  # no cache given: transformers makes one, the model's own forward runs
            assert len(calls) == 1
            assert torch.equal(model(prompt, cache=DynamicCache(config=model.config)).logits, expected)
            assert len(calls) == 2  # `input_ids` given first, as `auto`'s cost curve does
        seen = []
        handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: seen.append(1))
        with engine_kernels(model):
            model(input_ids=prompt, cache=DynamicCache(config=model.config))
        handle.remove()
        assert len(calls) == 2 and seen == [1]
        with pytest.raises(RuntimeError), engine_kernels(model):
            assert "forward" in model.__dict__
            raise RuntimeError("inside the forward")
        assert "forward" not in model.__dict__
    # a model whose own forward differs from what the lean one computes (an MLP changed by its owner) is probed
    # inexact, and runs its own forward inside the engine's kernels
    changed = target_of("qwen3", torch.float32)
    mlp = changed.model.layers[0].mlp
    mlp.forward = lambda x, stock=type(mlp).forward: stock(mlp, x) + 1.0
    assert LEAN_FORWARD not in engine_kernel_names(changed)
    with counted_lean_calls(monkeypatch) as calls, torch.no_grad(), engine_kernels(changed):
        changed(input_ids=prompt, cache=DynamicCache(config=changed.config))
    assert not calls and "forward" not in changed.__dict__


def test_treeflash_decodes_through_the_lean_forward(monkeypatch):
    """The engine's prefill and verify forwards take the lean path, and greedy TreeFlash equals plain decoding."""
    target = random_target("qwen3", seed=4)
    drafter = matching_drafter(target)
    prompt = torch.tensor([[3, 17, 45, 9, 100, 23, 7]])
    with torch.no_grad():
        plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
        with counted_lean_calls(monkeypatch) as calls:
            fast = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                                   tree_budget=8)
    assert torch.equal(plain, fast)
    steps = calls[len(calls) - calls[::-1].index(prompt.shape):]  # after the prefill (the probe's calls before it)
    assert steps and len(steps) < 24  # the verify steps, fewer than the tokens
