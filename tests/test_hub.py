"""Publishing: the dry-run repo, loading paths in fresh offline processes, the card, the upload, conversion.

No test reaches the network: loading runs with HF_HUB_OFFLINE=1 on local folders, and the upload test hands
`push` a fake `HfApi` that records its calls.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from treeflash_hf.hub.convert import ConversionError, convert
from treeflash_hf.hub.push import PublishError, check_publishable, prepare_repo, push, render_card
from treeflash_hf.recipes.testing import matching_drafter, random_target

from .conftest import randomise_ar_layer

PROMPT = [[5, 17, 3, 99, 42, 8]]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    target = random_target("qwen3", seed=0)
    drafter = randomise_ar_layer(matching_drafter(target, seed=1))
    target.save_pretrained(root / "target")
    drafter.save_pretrained(root / "drafter")
    bench = {"prompts": "stdlib-heldout", "max_new_tokens": 32, "temperature": 0.0, "device": "cpu", "results": {
        "autoregressive": {"method": "autoregressive", "budget": None, "tau": 1.0, "tokens_per_s": 100.0,
                           "speedup": 1.0, "identical_to_autoregressive": True},
        "treeflash@16": {"method": "treeflash", "budget": 16, "tau": 3.25, "tokens_per_s": 180.0, "speedup": 1.8,
                         "identical_to_autoregressive": True}}}
    folder = prepare_repo(root / "drafter", root / "repo", "org/treeflash-test", base_model="org/target-test",
                          bench=bench)
    expected = target.generate(torch.tensor(PROMPT), assistant_model=drafter, max_new_tokens=16, do_sample=False,
                               tree_budget=8)
    return root, folder, expected


def run_fresh(script: str, cwd) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(cwd / "hf_home"), "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=cwd, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_dry_run_layout(published):
    _, folder, _ = published
    for name in ("config.json", "model.safetensors", "generation_config.json", "README.md",
                 "modeling_treeflash_drafter.py", "configuration_treeflash_drafter.py", "custom_generate/generate.py",
                 "custom_generate/decode.py", "custom_generate/tree.py"):
        assert (folder / name).exists(), name
    assert json.loads((folder / "generation_config.json").read_text())["tree_budget"] == 64
    assert "auto_map" in json.loads((folder / "config.json").read_text())
    # the Hub copy of the engine is the installed engine, flattened into one folder
    from treeflash_hf.hub.folders import custom_generate_files

    for name, text in custom_generate_files("hub_generate").items():
        assert (folder / "custom_generate" / name).read_text() == text, name


def test_fresh_process_without_the_package(published):
    root, folder, expected = published
    result = run_fresh(f"""
        import json, sys, torch
        sys.modules["treeflash_hf"] = None  # the package must not be needed
        from transformers import AutoModel, AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained({str(root / "target")!r})
        drafter = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True)
        ids = torch.tensor({PROMPT})
        tree = target.generate(ids, assistant_model=drafter, custom_generate={str(folder)!r}, trust_remote_code=True,
                               max_new_tokens=16, do_sample=False, tree_budget=8, return_dict_in_generate=True)
        stock = target.generate(ids, assistant_model=drafter, speculation_type="dflash", max_new_tokens=16,
                                do_sample=False)
        plain = target.generate(ids, max_new_tokens=16, do_sample=False)
        print(json.dumps({{"tree": tree.sequences.tolist(), "sizes": tree.tree_sizes, "stock": stock.tolist(),
                          "plain": plain.tolist(), "cls": type(drafter).__module__}}))
    """, root)
    assert "treeflash_hf" not in result["cls"]
    assert result["tree"] == expected.tolist() == result["plain"] == result["stock"]
    assert max(result["sizes"]) <= 8


def test_fresh_process_with_the_package(published):
    root, folder, expected = published
    result = run_fresh(f"""
        import json, torch, treeflash_hf
        from transformers import AutoModel, AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained({str(root / "target")!r})
        drafter = AutoModel.from_pretrained({str(folder)!r})
        out = target.generate(torch.tensor({PROMPT}), assistant_model=drafter, max_new_tokens=16, do_sample=False,
                              tree_budget=8)
        print(json.dumps({{"out": out.tolist(), "cls": type(drafter).__module__}}))
    """, root)
    assert result["cls"].startswith("treeflash_hf")
    assert result["out"] == expected.tolist()


def test_card_metadata_and_metrics(published):
    from huggingface_hub import ModelCard

    _, folder, _ = published
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == "org/target-test"
    assert {"speculative-decoding", "treeflash"} <= set(card.data.tags)
    assert card.data.library_name == "transformers" and card.data.license == "apache-2.0"
    values = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert values == {"tau": 3.25, "speedup": 1.8}
    assert "| treeflash | 16 | 3.25 |" in card.text
    assert "trust_remote_code=True" in card.text and "import treeflash_hf" in card.text


def test_push_uploads_through_hfapi_and_refuses_bad_folders(published, tmp_path):
    _, folder, _ = published

    class RecordingApi:  # stands in for huggingface_hub.HfApi: the network is not reached
        def __init__(self):
            self.calls = []

        def create_repo(self, **kwargs):
            self.calls.append(("create_repo", kwargs))

        def create_branch(self, **kwargs):
            self.calls.append(("create_branch", kwargs))

        def upload_folder(self, **kwargs):
            self.calls.append(("upload_folder", kwargs))
            return type("Info", (), {"commit_url": "https://example.invalid/commit/1"})()

    api = RecordingApi()
    url = push(folder, "org/treeflash-test", private=True, revision="v1", commit_message="first", api=api)
    assert url.endswith("/commit/1")
    assert api.calls[0] == ("create_repo", {"repo_id": "org/treeflash-test", "private": True, "exist_ok": True,
                                            "repo_type": "model"})
    assert api.calls[1][0] == "create_branch" and api.calls[1][1]["branch"] == "v1"
    upload = api.calls[2][1]
    assert upload["folder_path"] == str(folder) and upload["revision"] == "v1" and upload["commit_message"] == "first"

    import shutil

    no_card = tmp_path / "no_card"
    shutil.copytree(folder, no_card)
    (no_card / "README.md").unlink()
    with pytest.raises(PublishError, match="missing \\['README.md'\\]"):
        push(no_card, "org/x", api=RecordingApi())
    wrong = tmp_path / "wrong"
    shutil.copytree(folder, wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["intermediate_size"] *= 2
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(PublishError, match="do not match its config"):
        check_publishable(wrong)
    del config["mask_token_id"]
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(PublishError, match="lacks \\['mask_token_id'\\]"):
        check_publishable(wrong)


# ---- conversion from the DFlash and TreeFlash-release formats -----------------------------------------------

H, HEADS, KV, HD, L, Q, V, INNER = 32, 4, 2, 8, 2, 4, 64, 48


def rmsnorm(x, weight, eps=1e-6):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x, positions, theta):
    inv = 1.0 / (theta ** (torch.arange(0, HD, 2).float() / HD))
    angles = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def dflash_reference(w, noise, context, positions, theta):
    """DFlash's forward written directly from the weight names (no treeflash_hf code)."""
    ctx = rmsnorm(context @ w["fc.weight"].T, w["hidden_norm.weight"])[0]
    h = noise[0]
    q_len, kv_len = h.shape[0], ctx.shape[0] + h.shape[0]
    for i in range(L):
        p = f"layers.{i}."
        x = rmsnorm(h, w[p + "input_layernorm.weight"])
        kv = torch.cat([ctx, x])
        q = rmsnorm((x @ w[p + "self_attn.q_proj.weight"].T).view(q_len, HEADS, HD), w[p + "self_attn.q_norm.weight"])
        k = rmsnorm((kv @ w[p + "self_attn.k_proj.weight"].T).view(kv_len, KV, HD), w[p + "self_attn.k_norm.weight"])
        v = (kv @ w[p + "self_attn.v_proj.weight"].T).view(kv_len, KV, HD)
        q = rope(q.transpose(0, 1), positions[-q_len:], theta)
        k = rope(k.transpose(0, 1), positions, theta).repeat_interleave(HEADS // KV, 0)
        v = v.transpose(0, 1).repeat_interleave(HEADS // KV, 0)
        attn = torch.softmax(q @ k.transpose(-1, -2) / HD**0.5, -1) @ v
        h = h + attn.transpose(0, 1).reshape(q_len, -1) @ w[p + "self_attn.o_proj.weight"].T
        y = rmsnorm(h, w[p + "post_attention_layernorm.weight"])
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return h  # before the final norm


def synthetic_dflash(folder, prefix="", treeflash=False, theta=1_000_000.0):
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * 0.1

    w = {"fc.weight": rand(H, 3 * H), "hidden_norm.weight": 1 + rand(H), "norm.weight": 1 + rand(H)}
    for i in range(L):
        p = f"layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rand(HEADS * HD, H), p + "self_attn.k_proj.weight": rand(KV * HD, H),
              p + "self_attn.v_proj.weight": rand(KV * HD, H), p + "self_attn.o_proj.weight": rand(H, HEADS * HD),
              p + "self_attn.q_norm.weight": 1 + rand(HD), p + "self_attn.k_norm.weight": 1 + rand(HD),
              p + "mlp.gate_proj.weight": rand(INNER, H), p + "mlp.up_proj.weight": rand(INNER, H),
              p + "mlp.down_proj.weight": rand(H, INNER), p + "input_layernorm.weight": 1 + rand(H),
              p + "post_attention_layernorm.weight": 1 + rand(H)}
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
              "intermediate_size": INNER, "num_hidden_layers": L, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "head_dim": HD, "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": theta,
              "max_position_embeddings": 2048, "block_size": Q, "num_target_layers": 8,
              "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": [1, 3, 5]}}
    ar = {}
    if treeflash:
        # the release's SwiGLUApproximation(hidden_size, config.intermediate_size)
        ar = {"ar_approximation.ug.weight": rand(2 * INNER, 2 * H), "ar_approximation.ug.bias": rand(2 * INNER),
              "ar_approximation.d.weight": rand(H, INNER), "ar_approximation.norm.weight": 1 + rand(H)}
        config["treeflash_config"] = {"ar_approximation": "swiglu", "candidate_tokens": 32}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({prefix + k: v.contiguous() for k, v in (w | ar).items()}, str(folder / "model.safetensors"))
    return w | ar


def inputs():
    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(1, Q, H, generator=generator)
    context = torch.randn(1, 5, 3 * H, generator=generator)
    return noise, context, torch.arange(0, 5 + Q)


def test_convert_dflash_checkpoint(tmp_path):
    weights = synthetic_dflash(tmp_path / "dflash", theta=500_000.0)
    model = convert(tmp_path / "dflash", tmp_path / "converted")
    noise, context, positions = inputs()
    with torch.no_grad():
        ours = model(noise_embeds=noise, context_hidden_states=context, position_ids=positions[None])
    reference = dflash_reference(weights, noise, context, positions, theta=500_000.0)
    torch.testing.assert_close(ours.pre_norm_hidden_state[0], reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.last_hidden_state[0], rmsnorm(reference, weights["norm.weight"]))
    assert torch.count_nonzero(model.ar_approximation.d.weight) == 0  # drafts exactly what DFlash drafts
    assert model.config.target_layer_ids == [1, 3, 5] and model.config.mask_token_id == V - 1


def test_convert_treeflash_release_checkpoint(tmp_path):
    weights = synthetic_dflash(tmp_path / "release", prefix="model.", treeflash=True)
    model = convert(tmp_path / "release")
    noise, context, positions = inputs()
    prev = torch.randn(Q, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h = model(noise_embeds=noise, context_hidden_states=context, position_ids=positions[None])
        ours = model.ar_corrected_hidden_states(h.pre_norm_hidden_state[0], prev)
    base = dflash_reference(weights, noise, context, positions, theta=1_000_000.0)
    normed = rmsnorm(base, weights["norm.weight"])
    u, g = (torch.cat([rmsnorm(prev, weights["ar_approximation.norm.weight"]), normed], -1)
            @ weights["ar_approximation.ug.weight"].T + weights["ar_approximation.ug.bias"]).chunk(2, -1)
    expected = rmsnorm(base + (torch.nn.functional.silu(g) * u) @ weights["ar_approximation.d.weight"].T,
                       weights["norm.weight"])
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert model.config.tree_budget == 32  # the release's tree size (`candidate_tokens`, root included)


def test_convert_rejects_other_checkpoints(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ConversionError, match="Not a DFlash drafter config"):
        convert(tmp_path / "bad")
    synthetic_dflash(tmp_path / "broken")
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ConversionError, match="not a readable safetensors file"):
        convert(tmp_path / "broken")
