"""Quantized targets (issue 22): the support matrix on a small random Llama, float32 compute.

For every backend that installs and runs on this CPU (the `quant` extra), greedy TreeFlash must be
token-identical to the quantized target's own plain `generate()`, with its lm_head left to the backend's
default and quantized too (not skipped, not tied). The drafter scores its drafts with the target's head: a plain
Linear through its weight, a quantized one through one exact dense copy or, where no copy reproduces it, by calling
it. Backends whose kernels make a token's logits depend on the other tokens of the forward (bitsandbytes' outlier
handling, torchao's dynamic int8 activations) are detected at the first call and warned about, once; dense and
weight-only targets never warn. Sampling from a quantized target keeps its distribution. Each library is optional:
its tests skip where it is not installed (`pip install -e ".[test,quant]"` has them all). Targets are quantized by
`treeflash_hf.quantize`, what `treeflash-hf bench --target-quant` runs.
"""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch

from treeflash_hf import TreeOptions, forget_learned_state, treeflash_generate
from treeflash_hf.engine.draft import TargetHead, TreeDrafter
from treeflash_hf.integrations.quantize import BACKENDS, quantize_target, reload_quantized
from treeflash_hf.recipes.testing import matching_drafter, random_target
from treeflash_hf.engine.validation import TreeFlashInputError
from treeflash_hf.engine.verify import forward_shape_difference

from .conftest import randomise_ar_layer
from .oracle import OracleCandidateGenerator
from .test_lossless_sampling import ALPHA, NEW_TOKENS, TEMPERATURE, TOP_P, VOCAB, chi_square_p, exact_joint

WARNING_TEXT = "depend on the other tokens in the forward"


def llama(seed: int = 0):
    return random_target("llama", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         seed=seed)


@pytest.fixture(scope="module")
def base_llama():
    """A random Llama (untied lm_head), float32: what each test quantizes (a copy of it)."""
    return llama()


@pytest.fixture(scope="module")
def drafter(base_llama):
    return randomise_ar_layer(matching_drafter(base_llama, seed=1))


# torchao configs that `--target-quant` does not offer, tested too: int4 in groups of 64, dynamic int8 activations
TORCHAO_EXTRA = {"torchao-int4-g64": lambda q: q.IntxWeightOnlyConfig(torch.int4, q.PerGroup(64)),
                 "torchao-dyn8": lambda q: q.Int8DynamicActivationInt8WeightConfig()}


def quantized(backend: str, base):
    """A copy of `base` quantized by `backend`, a `quantize_target` spec or a TORCHAO_EXTRA name; a name ending in
    "+head" quantizes lm_head as well. Skipped where the backend's library is not installed."""
    name, _, head = backend.partition("+")
    if name in TORCHAO_EXTRA:
        from transformers import TorchAoConfig

        config = TORCHAO_EXTRA[name](pytest.importorskip("torchao.quantization"))
        return reload_quantized(base, TorchAoConfig(config, modules_to_not_convert=[] if head else None))
    pytest.importorskip(BACKENDS[name].module)
    return quantize_target(copy.deepcopy(base), name, quantize_head=bool(head))


def prompts(seed: int, count: int = 2) -> list[torch.LongTensor]:
    rng = random.Random(seed)
    return [torch.tensor([[rng.randrange(511) for _ in range(rng.randint(4, 12))]]) for _ in range(count)]


def assert_lossless(target, drafter, max_new: int = 20) -> None:
    """Greedy TreeFlash (a random drafter at two budgets, and an oracle drafter that gets long paths accepted)
    equals the target's own `generate()`."""
    for index, prompt in enumerate(prompts(seed=3)):
        reference = target.generate(prompt, max_new_tokens=max_new + 8, do_sample=False)
        expected = reference[:, : prompt.shape[1] + max_new]
        for budget in (4, 16):
            out = target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new, do_sample=False,
                                  tree_budget=budget)
            assert torch.equal(out, expected), budget
        options = TreeOptions(tree_mode="treeflash", tree_budget=16, tree_top_m=4, tree_top_k=4)
        oracle = OracleCandidateGenerator(drafter, target, options, reference[0].tolist(), seed=index, max_rank=1)
        out = treeflash_generate(target, drafter, prompt, max_new_tokens=max_new, candidate_generator=oracle,
                                 tree_budget=16, tree_top_m=4, tree_top_k=4)
        assert torch.equal(out.sequences, expected)
        assert max(out.accepted_lengths) >= 3  # trees really were accepted deep into the quantized target


WEIGHT_ONLY = ["torchao-int8", "torchao-int8+head", "torchao-int4+head", "torchao-int4-g64", "quanto-int8+head",
               "quanto-int4", "quanto-int4+head", "hqq-4bit", "hqq-4bit+head"]


@pytest.mark.parametrize("backend", WEIGHT_ONLY)
def test_weight_only_backends_are_lossless(base_llama, drafter, backend, caplog):
    """Their quantized heads dequantize exactly: the drafter side gets one dense copy (its CPU shortlist reads rows)."""
    target = quantized(backend, base_llama)
    assert TreeDrafter(drafter, target, TreeOptions()).head.weight is not None
    with caplog.at_level(logging.WARNING, logger="treeflash_hf"):
        assert_lossless(target, drafter)
    assert WARNING_TEXT not in caplog.text


def test_called_head_and_its_shortlist_are_lossless(base_llama, drafter, monkeypatch):
    """A head with no exact dense copy is called: full logits, the CPU shortlist taken from them."""
    target = quantized("torchao-int8+head", base_llama)
    dense = TargetHead(target.lm_head, 128, torch.device("cpu"), torch.float32)
    monkeypatch.setattr("treeflash_hf.engine.draft.dense_weight_candidate", lambda module: None)
    called = TargetHead(target.lm_head, 128, torch.device("cpu"), torch.float32)
    assert called.weight is None and dense.weight is not None
    hidden, tokens = torch.randn(3, 2, 128), torch.randint(0, 512, (3, 64))
    torch.testing.assert_close(called.logits(hidden), dense.logits(hidden))
    torch.testing.assert_close(called.shortlist_logits(hidden, tokens), dense.shortlist_logits(hidden, tokens))
    assert called.logits(torch.randn(3, 0, 128)).shape == (3, 0, 512)  # no depth left: no call (torchao fails)
    assert_lossless(target, drafter)


def test_a_large_float32_head_scores_drafts_in_bfloat16_where_that_is_faster(monkeypatch):
    """On a CPU whose bfloat16 products are faster (measured once per shape), the drafting side scores with a
    bfloat16 copy of a large float32 head: the same logits up to bfloat16 rounding, the shortlist's rows from the
    same copy; where they are not faster, or the head is small, it keeps the target's own weight."""
    from treeflash_hf.engine import draft

    head = torch.nn.Linear(512, 8192)  # 4M elements: as large as the copy needs
    hidden = torch.randn(1, 16, 512)[:, 1:]  # a slice of drafter states, as drafting takes them
    tokens = torch.randint(0, 8192, (1, 15, 64))
    monkeypatch.setattr(draft, "bfloat16_product_is_faster", lambda *shape: False)
    kept = TargetHead(head, 512, torch.device("cpu"), torch.float32)
    assert kept.weight is head.weight
    monkeypatch.setattr(draft, "bfloat16_product_is_faster", lambda *shape: True)
    copied = TargetHead(head, 512, torch.device("cpu"), torch.float32)
    assert copied.weight.dtype == torch.bfloat16 and copied.weight.shape == head.weight.shape
    logits = copied.logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (1, 15, 8192)
    torch.testing.assert_close(logits, kept.logits(hidden), atol=0.05, rtol=0.02)
    assert (logits.argmax(-1) == kept.logits(hidden).argmax(-1)).float().mean() > 0.9
    shortlisted = copied.shortlist_logits(hidden[:, :, None], tokens)  # one row per group: [1, 15, 1, 64]
    torch.testing.assert_close(shortlisted[:, :, 0], logits.gather(-1, tokens), atol=0.05, rtol=0.02)
    small = torch.nn.Linear(128, 512, bias=False)
    assert TargetHead(small, 128, torch.device("cpu"), torch.float32).weight is small.weight
    # kept on the module across generate() calls, and made anew when the head's tensors change (a `.to()` keeps the
    # parameter objects and their versions)
    first = TargetHead.of(head, 512, torch.device("cpu"), torch.float32)
    assert TargetHead.of(head, 512, torch.device("cpu"), torch.float32) is first
    head.to(torch.float64)
    again = TargetHead.of(head, 512, torch.device("cpu"), torch.float32)
    assert again is not first and again.weight.dtype == torch.float64


def test_a_quantized_head_is_prepared_once_per_weights(base_llama, drafter, monkeypatch):
    """generate() after generate() reuses the dense copy of a quantized head; new weights make a new one."""
    target = quantized("torchao-int8+head", base_llama)
    made = []
    original = TargetHead.__init__
    monkeypatch.setattr(TargetHead, "__init__", lambda self, *a: (made.append(1), original(self, *a))[1])
    first = TreeDrafter(drafter, target, TreeOptions()).head
    assert TreeDrafter(drafter, target, TreeOptions()).head is first and len(made) == 1
    target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach().clone(), requires_grad=False)
    assert TreeDrafter(drafter, target, TreeOptions()).head is not first and len(made) == 2


def test_a_head_that_cannot_be_called_is_an_input_error(drafter):
    class BrokenHead(torch.nn.Module):
        def forward(self, hidden):
            raise RuntimeError("packed weights need a CUDA kernel")

    target = llama()
    target.lm_head = BrokenHead()
    with pytest.raises(TreeFlashInputError, match="BrokenHead.*CUDA kernel.*unquantized") as caught:
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=drafter, max_new_tokens=4, do_sample=False)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no torch trace attached


@pytest.mark.parametrize("backend", ["bnb-8bit+head", "bnb-nf4+head"])
def test_bitsandbytes_runs_with_a_quantized_head(base_llama, drafter, backend, caplog):
    """bitsandbytes heads (packed Int8Params / Params4bit) have no exact dense copy: the head is called. On real
    models their kernels couple the tokens of a forward (see the next test); on this one, whose activations have
    no outliers, no coupling shows, and then TreeFlash must be identical and silent."""
    target = quantized(backend, base_llama)
    assert TreeDrafter(drafter, target, TreeOptions()).head.weight is None
    with caplog.at_level(logging.WARNING, logger="treeflash_hf"):
        assert_lossless(target, drafter)
    assert WARNING_TEXT not in caplog.text


@pytest.mark.parametrize("backend,name", [("bnb-8bit", "bitsandbytes llm_int8"),
                                          ("torchao-dyn8+head", "torchao Int8DynamicActivationInt8WeightConfig")])
def test_forward_shape_dependent_backend_warns_once(drafter, caplog, backend, name):
    """LLM.int8 computes the input columns that hold an outlier (|x| > 6) in any token of the forward apart: give
    the Llama outlier features and a token's logits depend on the forward, on any host. torchao's dynamic int8
    activations are quantized per token, and whether its int8 kernels couple the rows depends on the CPU (they
    did on an Intel host with AMX, by ~1e-2; on an AMD Zen host, not for this prompt): there the warning must
    follow what the check finds, once, or not at all."""
    target = llama()
    with torch.no_grad():
        for layer in target.model.layers:
            layer.input_layernorm.weight[:3] = 30.0
            layer.post_attention_layernorm.weight[:3] = 30.0
    target = quantized(backend, target)
    prompt = prompts(seed=5, count=1)[0]
    with caplog.at_level(logging.WARNING, logger="treeflash_hf"):
        for _ in range(2):
            target.generate(prompt, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    warnings = [record.getMessage() for record in caplog.records if WARNING_TEXT in record.getMessage()]
    layer_ids = list(drafter.config.target_layer_ids)
    stable, _ = forward_shape_difference(target, prompt[0], layer_ids, torch.device("cpu"))
    assert backend != "bnb-8bit" or not stable
    assert len(warnings) == (0 if stable else 1), warnings
    assert stable or (name in warnings[0] and "near-ties" in warnings[0])


def test_dense_float32_target_never_warns(drafter, caplog):
    target = llama(seed=7)
    with caplog.at_level(logging.WARNING, logger="treeflash_hf"):
        for prompt in prompts(seed=6, count=3):
            target.generate(prompt, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    assert WARNING_TEXT not in caplog.text


def test_sampling_from_a_quantized_target_keeps_its_distribution():
    """test_lossless_sampling's chi-square check on a torchao int8 weight-only target, lm_head quantized (applied
    with `quantize_` directly: no `quantization_config`): samples follow the quantized target's own distribution."""
    quantization = pytest.importorskip("torchao.quantization")
    target = random_target("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                           seed=21)
    with torch.no_grad():  # sharpen the random head so that distributions are far from uniform
        target.lm_head.weight.mul_(15.0)
    quantization.quantize_(target, quantization.Int8WeightOnlyConfig())  # every Linear, lm_head included
    drafter = randomise_ar_layer(matching_drafter(target, seed=22, block_size=4), std=0.5)
    assert TreeDrafter(drafter, target, TreeOptions()).head.weight is not None
    prompt, samples = torch.tensor([[1, 4, 2]]), 1000
    expected = exact_joint(target, prompt, TEMPERATURE)
    torch.manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    accepted_total = 0
    for _ in range(samples):
        forget_learned_state(drafter)
        out = treeflash_generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS, do_sample=True,
                                 temperature=TEMPERATURE, top_p=TOP_P, tree_budget=4, tree_top_m=VOCAB,
                                 tree_top_k=VOCAB)
        outcome = tuple(out.sequences[0, prompt.shape[1]:].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
        accepted_total += sum(out.accepted_lengths)
    assert accepted_total > samples // 20
    assert chi_square_p(counts, expected, samples) > ALPHA
    assert chi_square_p(counts, exact_joint(target, prompt, TEMPERATURE * 1.5), samples) < ALPHA
