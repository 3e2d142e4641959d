"""`--target-quant` (issue 22): `quantize_target` on a tiny Llama, the bench's flag, and the cost-curve cache key
separating quantized targets from dense ones. Each backend's test skips where its library is not installed."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from treeflash_hf.tools import bench
from treeflash_hf import cli
from treeflash_hf.engine.budget import model_key
from treeflash_hf.integrations.quantize import (
    BACKENDS,
    QUANT_SPECS,
    Backend,
    QuantizationUnavailable,
    describe,
    quantization_config,
    quantize_target,
)
from treeflash_hf.recipes.testing import random_target
from treeflash_hf.engine.verify import NOT_QUANTIZED, quantization_backend


def tiny_llama(dtype: torch.dtype = torch.float32):
    target = random_target("llama", vocab_size=128, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    target.generation_config.eos_token_id = 5
    return target.to(dtype)


PROMPT = torch.tensor([[1, 7, 3, 9, 42]])


@pytest.mark.parametrize("spec", ["torchao-int8", "quanto-int4", "hqq-4bit"])
def test_quantize_target_quantizes_the_layers_and_keeps_the_head(spec):
    pytest.importorskip(BACKENDS[spec].module)
    dense = tiny_llama(torch.bfloat16)  # a bfloat16 target comes back computing in float32
    target = quantize_target(dense, spec)
    assert target.dtype == torch.float32 and quantization_backend(target) != NOT_QUANTIZED
    assert type(target.lm_head) is torch.nn.Linear and type(target.lm_head.weight) is torch.nn.Parameter
    assert target.generation_config.eos_token_id == 5
    with torch.no_grad():
        logits = target(PROMPT).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert describe(spec).startswith(BACKENDS[spec].distribution + " ") and "not installed" not in describe(spec)


def test_torchao_computes_in_bfloat16_when_asked_and_other_backends_say_they_cannot():
    pytest.importorskip("torchao")
    target = quantize_target(tiny_llama(), "torchao-int8", compute_dtype=torch.bfloat16)
    assert target.dtype == torch.bfloat16 and quantization_backend(target) != NOT_QUANTIZED
    with torch.no_grad():
        assert target(PROMPT).logits.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"quanto-int8 computes in float32 here .*torchao-int8, torchao-int4"):
        quantize_target(tiny_llama(), "quanto-int8", compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="computes in float32 here"):
        quantize_target(tiny_llama(), "torchao-int8", compute_dtype=torch.float16)
    dense = tiny_llama(torch.float16)  # no quantization: the bench's --dtype float16 keeps working
    assert quantize_target(dense, "none", compute_dtype=torch.float16) is dense


def test_quantize_target_is_what_loading_a_checkpoint_with_the_config_does(tmp_path):
    pytest.importorskip("torchao")
    dense = tiny_llama()
    dense.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization_config("torchao-int8"),
                                                  dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(quantize_target(dense, "torchao-int8")(PROMPT).logits, loaded(PROMPT).logits)


def test_none_returns_the_target_itself():
    target = tiny_llama()
    assert quantize_target(target, "none") is target
    assert describe("none") == "dense, not quantized"


def test_a_missing_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(BACKENDS, "bnb-8bit", Backend("no-such-dist", "no_such_module_xyz", "LLM.int8"))
    with pytest.raises(QuantizationUnavailable, match=r"no-such-dist.*pip install treeflash-hf\[quant\]") as caught:
        quantize_target(tiny_llama(), "bnb-8bit")
    assert isinstance(caught.value, ValueError)  # the command line reports it in one line
    assert describe("bnb-8bit") == "no-such-dist (not installed) LLM.int8"


def test_an_unknown_spec_is_an_argument_error_listing_the_choices(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--target-quant", "nope"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and all(spec in err for spec in QUANT_SPECS)


def test_bench_quantizes_the_target_in_float32_and_reports_it(monkeypatch, tmp_path, capsys):
    pytest.importorskip("optimum.quanto")
    loaded, benched = {}, {}

    def load(pair, dtype):
        loaded["dtype"] = dtype
        return tiny_llama(), None, None

    def run_bench(target, *args, **kwargs):
        benched["target"] = target
        return {"dtype": "float32", "results": {}}

    monkeypatch.setattr("treeflash_hf.reference.load", load)
    monkeypatch.setattr(bench, "load_prompts", lambda *args: ["a prompt"])
    monkeypatch.setattr(bench, "run_bench", run_bench)
    report_path = tmp_path / "report.json"
    assert cli.main(["bench", "--target-quant", "quanto-int8", "--modes", "treeflash", "--json", str(report_path),
                     "--threads", "1"]) == 0
    assert loaded["dtype"] == torch.float32  # --dtype auto: float32 for a quantized target
    assert "quanto" in quantization_backend(benched["target"])
    report = json.loads(report_path.read_text())
    assert report["target_quant"] == "quanto-int8" and "optimum-quanto" in report["target_quant_backend"]
    assert "target quantization quanto-int8" in capsys.readouterr().out


def quantize_directly(target):
    """torchao applied without transformers: the target's config stays the dense one's."""
    quantization = pytest.importorskip("torchao.quantization")
    quantization.quantize_(target, quantization.Int8WeightOnlyConfig())
    return target


def test_the_cost_curve_key_separates_quantized_from_dense_targets():
    dense, quantized = tiny_llama(), quantize_directly(tiny_llama())
    assert dense.config.to_dict() == quantized.config.to_dict()
    assert model_key(dense) == model_key(tiny_llama())
    assert model_key(quantized) != model_key(dense)


def test_bench_quant_measures_the_matrix_against_each_quantized_target(tmp_path, capsys):
    """On the tiny pair: the dense row and a weight-only row, each lossless, τ relative to the dense one."""
    pytest.importorskip("torchao")
    report_path = tmp_path / "matrix.json"
    assert cli.main(["bench-quant", "--pair", "tiny", "--specs", "none", "torchao-int8", "--prompts",
                     "packages-heldout", "--num-prompts", "1", "--max-new-tokens", "8", "--modes", "treeflash",
                     "--budgets", "4", "--threads", "1", "--json", str(report_path),
                     "--plot", str(tmp_path / "plots")]) == 0
    matrix = json.loads(report_path.read_text())["matrix"]
    assert [row["spec"] for row in matrix] == ["none", "torchao-int8"]
    for row in matrix:
        assert row["logits_stable"] and row["lossless"] == "yes"
        assert row["methods"]["treeflash@4"]["identical_to_autoregressive"] == "yes"
        assert row["plain_tokens_per_s"] > 0
    assert "Int8WeightOnlyConfig" in matrix[1]["backend"]
    assert (tmp_path / "plots" / "tau_by_quantization.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "vs dense" in out and "torchao-int8" in out


def test_the_lossless_cell_says_why_not():
    from treeflash_hf.tools.quant_bench import lossless_verdict

    clean = [{"near_tie_rows": 0, "divergent_rows": 0}]
    assert lossless_verdict(True, 0.0, clean) == "yes"
    assert lossless_verdict(False, 2.5, clean) == "no: a token's logits depend on the forward (up to 2.5)"
    assert lossless_verdict(True, 0.0, [{"near_tie_rows": 1, "divergent_rows": 2}]) == \
        "no: 3 rows differ from its own generate()"


def test_bench_runs_a_recalibrated_drafter_next_to_the_original(monkeypatch, tmp_path):
    drafter_dir = tmp_path / "recalibrated"
    drafter_dir.mkdir()
    benched = {}

    def run_bench(target, drafter, draft_lm, tokenizer, prompts, methods, *args, drafters=None, **kwargs):
        benched.update(labels=[m.label for m in methods], drafters=drafters)
        return {"dtype": "float32", "results": {}}

    monkeypatch.setattr("treeflash_hf.reference.load", lambda pair, dtype: (tiny_llama(), "original", None))
    monkeypatch.setattr("transformers.AutoModel.from_pretrained", lambda path, dtype: torch.nn.Identity())
    monkeypatch.setattr(bench, "load_prompts", lambda *args: ["a prompt"])
    monkeypatch.setattr(bench, "run_bench", run_bench)
    assert cli.main(["bench", "--recalibrated", str(drafter_dir), "--modes", "prompt_lookup", "treeflash", "auto",
                     "--budgets", "8", "--threads", "1"]) == 0
    assert benched["labels"] == ["autoregressive", "prompt_lookup", "treeflash@8", "auto@auto",
                                 "treeflash@8[recalibrated]", "auto@auto[recalibrated]"]
    assert set(benched["drafters"]) == {"recalibrated"}
