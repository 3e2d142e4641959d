"""Linear layers through oneDNN's packed weights (`integrations/cpu_linear.py`): the same products, the stock
module state, repacked when the weight changes, and TreeFlash lossless over a packed pair."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treeflash_hf import reference
from treeflash_hf.integrations import cpu_linear
from treeflash_hf.integrations.cpu_linear import PackedLinear, is_packed, pack_linears, unpack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def small_model(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96, bias=bias), nn.SiLU(), nn.Linear(96, 48, bias=False))


@pytest.mark.parametrize("shape", [(1, 48), (17, 48), (2, 5, 48), (0, 48)])
def test_packed_products_match_the_stock_ones(shape):
    model = small_model()
    x = torch.randn(*shape)
    with torch.no_grad():
        stock = model(x)
        assert pack_linears(model) == 2 and is_packed(model)
        packed = model(x)
    assert packed.shape == stock.shape
    torch.testing.assert_close(packed, stock, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.bfloat16 not in cpu_linear.packable_dtypes(), reason="this CPU has no bfloat16 arithmetic")
def test_packed_bfloat16_products_match_the_stock_ones_within_its_rounding():
    model = small_model().to(torch.bfloat16)
    x = torch.randn(17, 48, dtype=torch.bfloat16)
    with torch.no_grad():
        stock = model(x)
        assert pack_linears(model) == 2
        packed = model(x)
    assert packed.dtype == torch.bfloat16
    torch.testing.assert_close(packed, stock, rtol=2e-2, atol=2e-2)


def test_module_state_stays_stock_and_unpacks():
    model = small_model()
    before = {name: tensor for name, tensor in model.state_dict().items()}
    pack_linears(model)
    model(torch.randn(3, 48))
    after = model.state_dict()
    assert list(after) == list(before) and all(after[name] is before[name] or torch.equal(after[name], before[name])
                                               for name in before)  # no packed copy among the saved tensors
    assert all(isinstance(module, nn.Linear) for module in (model[0], model[2]))
    assert unpack_linears(model) == 2 and not is_packed(model)
    assert type(model[0]) is nn.Linear and "_packed" not in model[0].__dict__


def test_a_packed_model_copies_and_saves_without_its_packed_copies(tmp_path):
    import copy

    model = small_model()
    pack_linears(model, {(96, 48): 0, (48, 96): 0})
    x = torch.randn(3, 48)
    with torch.no_grad():
        expected = model(x)  # the packed copies exist now
        copied = copy.deepcopy(model)
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
        for other in (copied, loaded):
            assert type(other[0]) is PackedLinear and other[0].stock_max_rows == 0
            torch.testing.assert_close(other(x), expected)
    assert "_packed" in model[0].__dict__  # the original keeps its cache


def test_a_product_autograd_records_takes_the_stock_kernel(monkeypatch):
    model = small_model()
    pack_linears(model)
    calls = []
    packed_product = cpu_linear.packed_product
    monkeypatch.setattr(cpu_linear, "packed_product",
                        lambda x, packed, bias: calls.append(1) or packed_product(x, packed, bias))
    x = torch.randn(4, 48)
    model(x).sum().backward()  # training through a packed model: the stock product, so gradients reach the weights
    assert not calls and model[0].weight.grad is not None and model[2].weight.grad is not None
    with torch.no_grad():
        model(x)
    assert len(calls) == 2


def test_a_changed_weight_is_packed_again():
    """`load_state_dict` writes in place and a new Parameter replaces the old: the next forward uses the new weight
    (a stale packed copy would silently compute with the old one)."""
    model = small_model()
    pack_linears(model)
    x = torch.randn(4, 48)
    with torch.no_grad():
        model(x)
        model.load_state_dict({name: value * 2 for name, value in model.state_dict().items()})
        torch.testing.assert_close(model[0](x), nn.functional.linear(x, model[0].weight, model[0].bias),
                                   rtol=1e-5, atol=1e-5)
        model[2].weight = nn.Parameter(torch.randn(48, 96))
        hidden = torch.randn(4, 96)
        torch.testing.assert_close(model[2](hidden), hidden @ model[2].weight.T, rtol=1e-5, atol=1e-5)
        model[2].weight.data = torch.randn(48, 96)  # new storage under the same Parameter and version
        torch.testing.assert_close(model[2](hidden), hidden @ model[2].weight.T, rtol=1e-5, atol=1e-5)


def test_only_plain_cpu_layers_in_a_packable_dtype_are_packed(monkeypatch):
    class QuantizedLinear(nn.Linear):  # a quantization library's subclass keeps its own forward
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.float64), QuantizedLinear(8, 8))
    assert pack_linears(model) == 1
    assert [type(m) for m in model] == [PackedLinear, nn.Linear, QuantizedLinear]
    x = torch.randn(2, 8)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # a graph being compiled: the stock product
    assert torch.equal(model[0](x), nn.functional.linear(x, model[0].weight, model[0].bias))
    monkeypatch.undo()
    with torch.no_grad():  # a weight turned into a dtype oneDNN has no kernel for falls back to the stock product
        model[0].weight.data = model[0].weight.data.to(torch.float64)
        model[0].bias.data = model[0].bias.data.to(torch.float64)
        assert torch.equal(model[0](x.double()), nn.functional.linear(x.double(), model[0].weight, model[0].bias))
    mixed = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.float16))  # two dtypes: no single timed plan
    assert torch.float16 not in cpu_linear.packable_dtypes() or cpu_linear.plan_packed_linears(mixed) is None


def test_a_plan_keeps_few_rows_on_the_stock_product_and_leaves_out_shapes(monkeypatch):
    model = small_model()
    assert pack_linears(model, {(96, 48): 2}) == 1  # the (48, 96) layer is not in the plan: stays stock
    assert type(model[0]) is PackedLinear and type(model[2]) is nn.Linear and model[0].stock_max_rows == 2
    calls = []
    packed_product = cpu_linear.packed_product
    monkeypatch.setattr(cpu_linear, "packed_product",
                        lambda x, packed, bias: calls.append(tuple(x.shape)) or packed_product(x, packed, bias))
    with torch.no_grad():
        for shape in ((1, 48), (2, 48), (1, 2, 48), (3, 48), (2, 2, 48)):
            x = torch.randn(*shape)
            torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)
    assert calls == [(3, 48), (2, 2, 48)]  # at most 2 rows (however shaped) on the stock product, more packed


def test_auto_packs_only_by_a_timed_plan_and_an_explicit_dtype_stays_stock(monkeypatch):
    monkeypatch.setattr(reference, "cpu_has_native", lambda dtype: False)  # the tiny pair's bfloat16 runs as float32
    plan = {}
    monkeypatch.setattr(cpu_linear, "plan_packed_linears", lambda *models, **kwargs: plan)
    target, drafter, _ = reference.load("tiny")
    shapes = cpu_linear.linear_shapes(target, drafter)
    assert target.dtype == torch.float32 and not is_packed(target) and not is_packed(drafter)  # an empty plan
    plan.update({shape: 1 for shape in list(shapes)[:2]})
    target, drafter, _ = reference.load("tiny")
    packed = [module for model in (target, drafter) for module in model.modules() if type(module) is PackedLinear]
    assert packed and all(tuple(module.weight.shape) in plan and module.stock_max_rows == 1 for module in packed)
    monkeypatch.setattr(cpu_linear, "plan_packed_linears", lambda *models, **kwargs: None)
    target, drafter, _ = reference.load("tiny")
    assert not is_packed(target) and not is_packed(drafter)
    monkeypatch.setattr(cpu_linear, "plan_packed_linears", lambda *models, **kwargs: dict.fromkeys(shapes, 0))
    assert not is_packed(reference.load("tiny", dtype=torch.float32)[0])


def test_the_timing_plans_every_shape_and_is_asked_once():
    model = small_model()
    cpu_linear._timed_plan.cache_clear()
    first = cpu_linear.plan_packed_linears(model)
    assert first is None or (set(first) <= {(96, 48), (48, 96)} and all(
        rows in (0, *cpu_linear.PROBE_ROWS) for rows in first.values()))
    assert cpu_linear.plan_packed_linears(model) == first and cpu_linear._timed_plan.cache_info().hits == 1
    assert cpu_linear.linear_shapes(model) == {(96, 48): 1, (48, 96): 1}
    assert cpu_linear.plan_packed_linears(nn.Sequential(nn.SiLU())) is None  # nothing to pack


def test_no_plan_where_the_packed_copies_would_not_fit_in_memory(monkeypatch):
    model = small_model()  # 2 * 48 * 96 float32 weights: 36,864 bytes of packed copies
    cpu_linear._timed_plan.cache_clear()
    monkeypatch.setattr(cpu_linear, "_timed_plan", lambda *args: (((96, 48), 0), ((48, 96), 0)))
    monkeypatch.setattr(cpu_linear, "available_memory_bytes", lambda: 2 * 36_864)
    assert cpu_linear.plan_packed_linears(model) == {(96, 48): 0, (48, 96): 0}
    monkeypatch.setattr(cpu_linear, "available_memory_bytes", lambda: 2 * 36_864 - 1)
    assert cpu_linear.plan_packed_linears(model) is None
    monkeypatch.undo()
    available = cpu_linear.available_memory_bytes()
    assert available is None or available > 0  # (None where /proc/meminfo does not say)


def test_the_cost_curves_key_names_the_packed_kernels():
    from treeflash_hf.engine.budget import model_key

    target = reference.load("tiny", dtype=torch.float32)[0]
    stock = model_key(target)
    shapes = cpu_linear.linear_shapes(target)
    pack_linears(target, dict.fromkeys(shapes, 1))
    packed = model_key(target)
    pack_linears(target, dict.fromkeys(shapes, 4))
    assert len({stock, packed, model_key(target)}) == 3  # a curve timed on other kernels is not reused
    unpack_linears(target)
    assert model_key(target) == stock


def test_the_bench_times_plain_decoding_on_the_stock_kernels_beside_the_packed_run(monkeypatch):
    from treeflash_hf.tools.bench import parse_methods, run_bench

    target, drafter, tokenizer = reference.load("tiny", dtype=torch.float32)
    methods = parse_methods(["stock_kernels", "treeflash"], [8])
    report = run_bench(target, drafter, None, tokenizer, ["def f(x):"], methods, 12, 0.0, 1, progress=False,
                       measure_shape_noise=False)
    assert "stock_kernels" not in report["results"]  # nothing packed: the same as autoregressive, left out
    plan = dict.fromkeys(cpu_linear.linear_shapes(target, drafter), 0)
    pack_linears(target, plan), pack_linears(drafter, plan)
    stock_calls = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda *args, **kwargs: stock_calls.append(1) or linear(*args, **kwargs))
    with cpu_linear.stock_kernels(target):
        assert not is_packed(target)
        target(torch.tensor([[1, 2, 3]]))
    assert stock_calls and is_packed(target) and all(module.stock_max_rows == 0 for module in target.modules()
                                                     if type(module) is PackedLinear)
    report = run_bench(target, drafter, None, tokenizer, ["def f(x):"], methods, 12, 0.0, 1, progress=False,
                       measure_shape_noise=False)
    row = report["results"]["stock_kernels"]
    assert report["packed_linear"] and row["new_tokens"] == 12 and row["identical_rows"] + row["near_tie_rows"] == 1


def test_the_demo_shows_plain_decoding_on_the_stock_kernels_when_packed(monkeypatch, capsys):
    from treeflash_hf.cli import main

    monkeypatch.setattr(reference, "cpu_has_native", lambda dtype: False)  # the tiny pair runs as float32
    monkeypatch.setattr(cpu_linear, "plan_packed_linears", lambda *models, **kwargs: dict.fromkeys(
        cpu_linear.linear_shapes(*models), 0))
    status = main(["demo", "--pair", "tiny", "--max-new-tokens", "16", "--repeats", "1"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "linear layers packed for oneDNN" in printed and "plain, stock kernels" in printed
    assert "TreeFlash over it: drafter alone" in printed


def test_greedy_treeflash_over_a_packed_pair_is_the_packed_targets_own_output():
    target, drafter, tokenizer = reference.load("tiny", dtype=torch.float32)
    plan = dict.fromkeys(cpu_linear.linear_shapes(target, drafter), 1)  # a decode step stock, a verify step packed
    pack_linears(target, plan), pack_linears(drafter, plan)
    prompt = tokenizer("import os\n\n\ndef read_lines(path):\n", return_tensors="pt")
    plain = target.generate(**prompt, max_new_tokens=48, do_sample=False)
    for mode, budget in (("treeflash", 16), ("treeflash", "auto")):
        out = target.generate(**prompt, assistant_model=drafter, max_new_tokens=48, do_sample=False, tree_mode=mode,
                              tree_budget=budget, tree_lookup=8, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain), (mode, budget)
        assert out.tau > 1.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_products_are_bit_identical_and_only_inside_the_engine(monkeypatch, dtype):
    """Inside the engine's forwards the projections that read the same input (query/key/value, gate/up) run as one
    packed product: the logits equal the layers' own products bit for bit (a prefill and a step on its cache), every
    group is fused once per forward, nothing is fused outside or past FUSED_MAX_ROWS rows, no output is held after
    the forward, a weight changed in place is packed again, a copy of the model carries no group, and the engine's
    kernels name the fused products (the cost curve's key) only while the layers are packed."""
    import contextlib
    import copy

    from transformers import DynamicCache

    from treeflash_hf.engine import onednn
    from treeflash_hf.engine.attention import tree_attention
    from treeflash_hf.engine.kernels import FUSED_PRODUCTS, engine_kernel_names, engine_kernels
    from treeflash_hf.recipes.testing import random_target

    if dtype not in cpu_linear.packable_dtypes():
        pytest.skip("this CPU has no bfloat16 arithmetic")
    target = random_target("llama", vocab_size=64, num_heads=4, num_kv_heads=2, seed=3).to(dtype)
    assert not onednn.fused_groups(target) and pack_linears(target)  # (groups found again once packed)
    fused_calls = []
    views = onednn.FusedProducts.views  # (every fused product: the members' copies and the lean forward's views)
    monkeypatch.setattr(onednn.FusedProducts, "views",
                        lambda group, input: fused_calls.append(input.shape[-2]) or views(group, input))
    step = torch.tensor([[7, 21, 40]])

    def logits(kernels, prompt_len: int = 6):
        prompt = torch.randint(0, 64, (1, prompt_len), generator=torch.Generator().manual_seed(1))
        cache = DynamicCache(config=target.config)
        with torch.no_grad(), kernels:
            return target(prompt, cache=cache).logits, target(step, cache=cache).logits

    def same(first, second) -> bool:
        return all(torch.equal(a, b) for a, b in zip(first, second))

    stock = logits(contextlib.nullcontext())
    assert not fused_calls  # outside the engine every layer multiplies alone
    groups = onednn.fused_groups(target)
    assert len(groups) == 2 * target.config.num_hidden_layers and FUSED_PRODUCTS in engine_kernel_names(target)
    fused_calls.clear()  # (naming the kernels probed the lean forward on them)
    assert same(stock, logits(onednn.fused_products(target)))
    assert fused_calls == [6] * len(groups) + [3] * len(groups)  # every group, once per forward
    assert all(group.local.memo is None for group in groups)  # nothing held past the forward
    assert same(logits(tree_attention(target)), logits(engine_kernels(target)))  # the attention alike with or without
    fused_calls.clear()
    long = onednn.FUSED_MAX_ROWS + 1
    assert same(logits(contextlib.nullcontext(), long), logits(onednn.fused_products(target), long))
    assert fused_calls == [3] * len(groups)  # the long prefill multiplied layer by layer, the step fused
    attention, inputs = target.model.layers[1].self_attn, torch.randn(2, 1, 4, 64).to(dtype)
    with torch.no_grad():
        alone = attention.k_proj(inputs[1])
        with onednn.fused_products(target):
            attention.q_proj(inputs[0])
            assert torch.equal(attention.k_proj(inputs[1]), alone)  # another input: its own product, not the held one
        target.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # in place: the stacked copy follows
    assert same(logits(contextlib.nullcontext()), logits(onednn.fused_products(target)))
    assert not any("fused_group" in module.__dict__ for module in copy.deepcopy(target).modules())
    assert unpack_linears(target) and FUSED_PRODUCTS not in engine_kernel_names(target)


def test_the_bench_times_plain_decoding_inside_the_engine_kernels():
    from treeflash_hf.engine.kernels import FUSED_PRODUCTS, engine_kernel_names
    from treeflash_hf.tools.bench import parse_methods, run_bench

    target, drafter, tokenizer = reference.load("tiny", dtype=torch.float32)
    pack_linears(target, dict.fromkeys(cpu_linear.linear_shapes(target), 0))
    assert FUSED_PRODUCTS in engine_kernel_names(target)
    report = run_bench(target, drafter, None, tokenizer, ["def f(x):"], parse_methods(["engine_kernels"], [8]), 12,
                       0.0, 1, progress=False, measure_shape_noise=False)
    row = report["results"]["engine_kernels"]  # plain decoding, its products fused: the same tokens
    assert row["new_tokens"] == 12 and row["identical_rows"] == 1
