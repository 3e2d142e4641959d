"""Published drafters load as they are published: z-lab DFlash (`dflash/model.py`; SpecForge and speculators export
the same layout) and the TreeFlash authors' release (ETH-DISCO/TreeFlash `tree_flash.py`).

The fixtures are the two projects' config.json files and weight names as their code writes them (tiny sizes): a
Qwen3 config plus the DFlash keys, saved by transformers 4.57 (z-lab's b16 drafters: flat `rope_theta`, `rope_scaling`)
or 5.x (the release: `rope_parameters`); the DFlash modules `fc`, `hidden_norm`, `layers.N...`, `norm` (under `model.`
in the release) and the release's AR layer `ar_approximation.{ug, d, norm}`. Random weights are saved under those
names, loaded with `from_pretrained`, and checked tensor by tensor; drafts are checked against a reference written
here from the published math (no treeflash_hf code in it).
"""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModel, DynamicCache, Qwen3Config
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from treeflash_hf import TreeFlashCandidateGenerator, TreeFlashDrafterModel, TreeOptions
from treeflash_hf.hub.convert import ConversionError, convert
from treeflash_hf.engine.draft import DraftContext
from treeflash_hf.recipes.testing import random_target

from .test_cli_errors import assert_tool_failure, run_cli

H, HEADS, KV, HD, LAYERS, INNER, V, Q, TARGET_LAYERS = 32, 4, 2, 8, 2, 48, 64, 6, 8
MASK = V - 1

# z-lab/Qwen3-{4B,8B}-DFlash-b16 config.json as published (transformers 4.57.3 wrote it), at tiny sizes.
ZLAB_CONFIG = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": Q, "bos_token_id": 0,
    "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5]}, "dtype": "bfloat16", "eos_token_id": 1,
    "head_dim": HD, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": INNER,
    "layer_types": ["full_attention"] * LAYERS, "max_position_embeddings": 40960, "max_window_layers": LAYERS,
    "model_type": "qwen3", "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "num_key_value_heads": KV,
    "num_target_layers": TARGET_LAYERS, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "transformers_version": "4.57.3", "use_cache": True,
    "use_sliding_window": False, "vocab_size": V,
}

# The release's config (a Qwen3Config saved by transformers 5.x, as its pinned 5.8.1 writes it, plus
# `treeflash_config`), at tiny sizes.
RELEASE_CONFIG = {
    "architectures": ["TreeFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0, "block_size": Q,
    "bos_token_id": 0, "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5]}, "dtype": "bfloat16",
    "eos_token_id": 1, "head_dim": HD, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
    "intermediate_size": INNER, "layer_types": ["full_attention"] * LAYERS, "max_position_embeddings": 40960,
    "max_window_layers": LAYERS, "model_type": "qwen3", "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
    "num_key_value_heads": KV, "num_target_layers": TARGET_LAYERS, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "sliding_window": None,
    "tie_word_embeddings": True, "transformers_version": "5.8.1", "use_cache": True, "use_sliding_window": False,
    "vocab_size": V, "treeflash_config": {"ar_approximation": "swiglu", "candidate_tokens": 32},
}


def dflash_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the names `DFlashDraftModel` (z-lab) registers, in state-dict order of its modules."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, around=0.0):
        return around + torch.randn(*shape, generator=g) * 0.1

    w = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rand(HEADS * HD, H), p + "self_attn.k_proj.weight": rand(KV * HD, H),
              p + "self_attn.v_proj.weight": rand(KV * HD, H), p + "self_attn.o_proj.weight": rand(H, HEADS * HD),
              p + "self_attn.q_norm.weight": rand(HD, around=1), p + "self_attn.k_norm.weight": rand(HD, around=1),
              p + "mlp.gate_proj.weight": rand(INNER, H), p + "mlp.up_proj.weight": rand(INNER, H),
              p + "mlp.down_proj.weight": rand(H, INNER), p + "input_layernorm.weight": rand(H, around=1),
              p + "post_attention_layernorm.weight": rand(H, around=1)}
    w |= {"norm.weight": rand(H, around=1), "fc.weight": rand(H, 3 * H), "hidden_norm.weight": rand(H, around=1)}
    return w


def release_ar_weights(seed: int = 5) -> dict[str, torch.Tensor]:
    """`SwiGLUApproximation(hidden_size, config.intermediate_size)`: ug Linear 2H -> 2I with bias, d I -> H, norm H."""
    g = torch.Generator().manual_seed(seed)
    return {"ar_approximation.ug.weight": torch.randn(2 * INNER, 2 * H, generator=g) * 0.2,
            "ar_approximation.ug.bias": torch.randn(2 * INNER, generator=g) * 0.1,
            "ar_approximation.d.weight": torch.randn(H, INNER, generator=g) * 0.2,
            "ar_approximation.norm.weight": 1 + torch.randn(H, generator=g) * 0.1}


def write_folder(folder, config: dict, weights: dict[str, torch.Tensor]):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def zlab_folder(root, config_changes=None, seed=0):
    config = copy.deepcopy(ZLAB_CONFIG) | (config_changes or {})
    weights = dflash_weights(seed)
    return write_folder(root, config, weights), weights


def release_folder(root, config_changes=None, with_ar=True):
    config = copy.deepcopy(RELEASE_CONFIG) | (config_changes or {})
    weights = {"model." + name: tensor for name, tensor in dflash_weights().items()}
    if with_ar:
        weights |= release_ar_weights()
    return write_folder(root, config, weights), weights


# ---- an independent reference of the published math ------------------------------------------------------------
def rms(x, weight, eps=1e-6):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def plain_cos_sin(positions, theta=1_000_000.0):
    inv = 1.0 / (theta ** (torch.arange(0, HD, 2).float() / HD))
    angles = positions[:, None].float() * inv[None]
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


def dflash_reference(w, noise, context, positions, cos_sin=None, windows=None, causal=None):
    """z-lab's DFlash forward for one row, from the weight names: `noise [Q, H]`, `context [C, n*H]`, `positions
    [C+Q]`; per layer an optional sliding window and causal flag (query p sees key k when p - k < window, k - p <
    window unless causal, k <= p when causal). Returns the last layer's output before the final norm `[Q, H]`."""
    cos, sin = cos_sin if cos_sin is not None else plain_cos_sin(positions)
    ctx = rms(context @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = noise
    q_len, kv_len = h.shape[0], ctx.shape[0] + h.shape[0]
    distance = positions[-q_len:, None] - positions[None, :]  # [Q, C+Q]
    for i in range(LAYERS):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        kv = torch.cat([ctx, x])
        q = rms((x @ w[p + "self_attn.q_proj.weight"].T).view(q_len, HEADS, HD), w[p + "self_attn.q_norm.weight"])
        k = rms((kv @ w[p + "self_attn.k_proj.weight"].T).view(kv_len, KV, HD), w[p + "self_attn.k_norm.weight"])
        v = (kv @ w[p + "self_attn.v_proj.weight"].T).view(kv_len, KV, HD)
        q = rotate(q.transpose(0, 1), cos[-q_len:], sin[-q_len:])
        k = rotate(k.transpose(0, 1), cos, sin).repeat_interleave(HEADS // KV, 0)
        v = v.transpose(0, 1).repeat_interleave(HEADS // KV, 0)
        scores = q @ k.transpose(-1, -2) / math.sqrt(HD)
        visible = torch.ones_like(distance, dtype=torch.bool)
        window = windows[i] if windows else None
        if window is not None:
            visible &= distance < window
            if not (causal and causal[i]):
                visible &= distance > -window
        if causal and causal[i]:
            visible &= distance >= 0
        scores = scores.masked_fill(~visible, -math.inf)
        h = h + (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(q_len, -1) @ w[p + "self_attn.o_proj.weight"].T
        y = rms(h, w[p + "post_attention_layernorm.weight"])
        h = h + (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"].T
    return h


def release_ar_reference(w, h, prev_embeds):
    """The release's AR correction (SPEC 1.2): `norm(h + d(silu(g) * u))`, `[u ; g] = ug([norm_e(e_prev) ;
    norm(h)])`, u first (`u, g = self.ug(x).chunk(2)`), norm_e with eps 1e-6, `norm` the backbone's final norm."""
    normed = rms(h, w["norm.weight"])
    u, g = (torch.cat([rms(prev_embeds, w["ar_approximation.norm.weight"], eps=1e-6), normed], -1)
            @ w["ar_approximation.ug.weight"].T + w["ar_approximation.ug.bias"]).chunk(2, -1)
    return rms(h + (F.silu(g) * u) @ w["ar_approximation.d.weight"].T, w["norm.weight"])


def inputs(seed=1, context_len=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, Q, H, generator=g), torch.randn(1, context_len, 3 * H, generator=g),
            torch.arange(context_len + Q))


def assert_every_weight_in_place(model, weights, prefix=""):
    state = model.state_dict()
    for name, tensor in weights.items():
        ours = name.removeprefix(prefix) if not name.startswith("ar_approximation.") else name
        assert torch.equal(state[ours], tensor.to(state[ours].dtype)), name
    loaded = {name.removeprefix(prefix) if not name.startswith("ar_approximation.") else name for name in weights}
    return set(state) - loaded  # drafter weights the checkpoint did not provide


def decoding_defaults(model):
    return {name: getattr(model.generation_config, name)
            for name in ("tree_mode", "tree_budget", "tree_top_m", "tree_top_k", "tree_lookup")}


# ---- z-lab DFlash ----------------------------------------------------------------------------------------------
def test_zlab_folder_loads_every_weight_and_drafts_as_dflash(tmp_path):
    folder, weights = zlab_folder(tmp_path / "Qwen3-8B-DFlash-b16")
    model = TreeFlashDrafterModel.from_pretrained(folder, dtype=torch.float32)
    not_loaded = assert_every_weight_in_place(model, weights)
    assert not_loaded == {"ar_approximation.ug.weight", "ar_approximation.ug.bias", "ar_approximation.d.weight",
                          "ar_approximation.norm.weight"}
    assert torch.count_nonzero(model.ar_approximation.d.weight) == 0  # the identity: drafts what DFlash drafts
    config = model.config
    assert (config.mask_token_id, config.target_layer_ids, config.block_size, config.rope_theta) == (
        MASK, [1, 3, 5], Q, 1_000_000)
    assert config.layer_types == ["full_attention"] * LAYERS and getattr(config, "rope_parameters", None) is None
    assert decoding_defaults(model) == {"tree_mode": "marginal_tree", "tree_budget": 64, "tree_top_m": 16,
                                        "tree_top_k": 16, "tree_lookup": 0}
    noise, context, positions = inputs()
    with torch.no_grad():
        out = model(noise_embeds=noise, context_hidden_states=context, position_ids=positions[None])
    reference = dflash_reference(weights, noise[0], context[0], positions)
    torch.testing.assert_close(out.pre_norm_hidden_state[0], reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.last_hidden_state[0], rms(reference, weights["norm.weight"]), atol=1e-5, rtol=1e-5)
    # AutoModel (after `import treeflash_hf`) takes the same path instead of building a bare Qwen3Model
    auto = AutoModel.from_pretrained(folder, dtype=torch.float32)
    assert isinstance(auto, TreeFlashDrafterModel)
    assert_every_weight_in_place(auto, weights)


def test_zlab_layout_with_newer_spellings_and_the_speculators_variant(tmp_path):
    """`dflash_config.block_size` (newer z-lab drafters), top-level `mask_token_id`/`target_layer_ids` (read as
    z-lab's `_draft_value` reads them) and `rope_parameters` (transformers 5) all map."""
    changes = {"dflash_config": {"block_size": 4, "target_layer_ids": [2, 6]}, "mask_token_id": 7,
               "rope_scaling": None, "rope_theta": None, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    config = copy.deepcopy(ZLAB_CONFIG) | changes
    del config["block_size"], config["rope_scaling"], config["rope_theta"]
    weights = dflash_weights()
    weights["fc.weight"] = weights["fc.weight"][:, : 2 * H]
    model = TreeFlashDrafterModel.from_pretrained(write_folder(tmp_path / "d", config, weights), dtype=torch.float32)
    assert (model.config.block_size, model.config.mask_token_id, model.config.target_layer_ids,
            model.config.rope_theta) == (4, 7, [2, 6], 5e5)
    assert_every_weight_in_place(model, weights)


# ---- the TreeFlash authors' release ------------------------------------------------------------------------------
def draft_block(target, drafter, prompt):
    options = TreeOptions(tree_mode="treeflash", tree_budget=16, tree_top_m=4, tree_top_k=5)
    generator = TreeFlashCandidateGenerator(drafter, target, options)
    generator.ar_shortlist = None  # full-vocabulary rows, as the release scores them
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
    context = generator.context_features(out.hidden_states, slice(None))
    anchor = int(out.logits[0, -1].argmax())
    block = generator.draft([anchor], torch.tensor([prompt.shape[1]]), DraftContext(context, torch.arange(
        prompt.shape[1])[None]), max_depth=Q - 1)[0]
    return generator, block, context[0], anchor


def test_release_folder_loads_every_weight_and_drafts_like_the_release(tmp_path):
    folder, weights = release_folder(tmp_path / "treeflash-qwen3-8b")
    drafter = TreeFlashDrafterModel.from_pretrained(folder, dtype=torch.float32).eval()
    assert assert_every_weight_in_place(drafter, weights, prefix="model.") == set()
    assert drafter.ar_approximation.norm.variance_epsilon == 1e-6
    assert decoding_defaults(drafter) == {"tree_mode": "treeflash", "tree_budget": 32, "tree_top_m": 16,
                                          "tree_top_k": 16, "tree_lookup": 0}
    # The drafts: stage-1 top tokens of each marginal and stage-2 AR tables, against the release's math
    target = random_target("qwen3", vocab_size=V, hidden_size=H, num_layers=TARGET_LAYERS, num_heads=HEADS,
                           num_kv_heads=KV, seed=3)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    generator, block, context, anchor = draft_block(target, drafter, prompt)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    noise = embed[torch.tensor([anchor] + [MASK] * (Q - 1))]
    with torch.no_grad():
        h = dflash_reference(weights | {k.removeprefix("model."): v for k, v in weights.items()}, noise, context,
                             torch.arange(prompt.shape[1] + Q))
        table = generator.ar_tables([block], block.depth)[0]
        w = {k.removeprefix("model."): v for k, v in weights.items()}
        marginals = torch.log_softmax(rms(h, w["norm.weight"]) @ head.T, -1)  # [Q, V]
        for depth in range(1, block.depth):
            assert torch.equal(table.top[depth], marginals[depth].topk(4).indices)
        for depth in range(block.depth):
            parents = [anchor] if depth == 0 else table.top[depth].tolist()
            for j, parent in enumerate(parents):
                corrected = release_ar_reference(w, h[depth + 1], embed[parent])
                expected = torch.log_softmax(corrected @ head.T, -1).topk(5)
                assert torch.equal(table.child_tokens[depth, j], expected.indices), (depth, j)
                torch.testing.assert_close(table.child_log_probs[depth, j], expected.values, atol=1e-4, rtol=1e-4)
    # The loaded drafter is lossless inside generate() as any of ours
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    fast = target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False)
    assert torch.equal(plain, fast)


@pytest.mark.parametrize("case", ["nested", "top-level", "null", "top-level-null", "no-candidate-tokens"])
def test_release_config_is_read_as_the_release_writes_it(tmp_path, case):
    """`treeflash_config.{ar_approximation, candidate_tokens}` with top-level fallbacks (`_treeflash_config(config)
    .get(name, getattr(config, name, default))`); ar_approximation null: a plain DFlash drafter."""
    changes = {"nested": {},
               "top-level": {"treeflash_config": {}, "ar_approximation": "swiglu", "candidate_tokens": 48},
               "null": {"treeflash_config": {"ar_approximation": None, "candidate_tokens": 24}},
               "top-level-null": {"treeflash_config": {"candidate_tokens": 16}, "ar_approximation": None},
               "no-candidate-tokens": {"treeflash_config": {"ar_approximation": "swiglu"}}}[case]
    with_ar = case in ("nested", "top-level", "no-candidate-tokens")
    folder, weights = release_folder(tmp_path / case, changes, with_ar=with_ar)
    model = TreeFlashDrafterModel.from_pretrained(folder, dtype=torch.float32)
    not_loaded = assert_every_weight_in_place(model, weights, prefix="model.")
    expected_mode = "treeflash" if with_ar else "marginal_tree"
    expected_budget = {"nested": 32, "top-level": 48, "null": 24, "top-level-null": 16, "no-candidate-tokens": 64}
    assert (model.generation_config.tree_mode, model.generation_config.tree_budget) == (expected_mode,
                                                                                        expected_budget[case])
    if not with_ar:
        assert {k for k in not_loaded} == {k for k in model.state_dict() if k.startswith("ar_approximation.")}
        assert torch.count_nonzero(model.ar_approximation.d.weight) == 0


def test_release_folder_without_its_ar_weights_is_refused(tmp_path):
    folder, _ = release_folder(tmp_path / "incomplete", with_ar=False)
    with pytest.raises(ValueError, match="declares an AR layer") as caught:
        TreeFlashDrafterModel.from_pretrained(folder)
    for key in ("ar_approximation.ug.weight", "ar_approximation.ug.bias", "ar_approximation.d.weight",
                "ar_approximation.norm.weight"):
        assert key in str(caught.value)
    with pytest.raises(ValueError, match="ar_approximation.d.weight"):  # the converter says the same
        convert(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # and AR weights under a config that declares none are not silently loaded either
    folder, _ = release_folder(tmp_path / "undeclared", {"treeflash_config": {"ar_approximation": None}})
    with pytest.raises(ValueError, match="holds AR-layer weights"):
        TreeFlashDrafterModel.from_pretrained(folder)


def test_convert_writes_our_layout_and_it_reloads_identically(tmp_path):
    folder, weights = release_folder(tmp_path / "release")
    converted = convert(folder, tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["model_type"] == "treeflash_drafter" and "_checkpoint_layout" not in saved
    reloaded = TreeFlashDrafterModel.from_pretrained(tmp_path / "ours")
    assert reloaded.config._checkpoint_layout is None  # our layout now: no published mapping on the way in
    assert converted.dtype == torch.float32
    for name, tensor in converted.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    assert decoding_defaults(reloaded) == decoding_defaults(converted)


# ---- RoPE from the config ----------------------------------------------------------------------------------------
ROPES = {
    # z-lab's newer drafters (Qwen3.6-style YaRN), in both spellings transformers has written
    "yarn-rope_scaling": {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                          "max_position_embeddings": 131072},
    "yarn-rope_parameters": {"rope_scaling": None, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e7},
        "max_position_embeddings": 131072},
    # z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat: llama3 scaling
    "llama3": {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "max_position_embeddings": 131072},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 64},
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_scaled_rope_is_kept_as_transformers_computes_it(tmp_path, kind):
    folder, weights = zlab_folder(tmp_path / kind, ROPES[kind])
    model = TreeFlashDrafterModel.from_pretrained(folder, dtype=torch.float32)
    source = {k: v for k, v in json.loads((folder / "config.json").read_text()).items()
              if k not in ("dflash_config", "auto_map", "architectures", "model_type")}
    theirs = Qwen3RotaryEmbedding(Qwen3Config(**source))  # what z-lab's DFlashDraftModel builds
    ours = model.rotary_emb
    assert ours.rope_type == theirs.rope_type != "default"
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq, atol=0, rtol=0)
    assert ours.attention_scaling == theirs.attention_scaling
    positions = torch.tensor([[0, 1, 5, 40, 70, 100, 5000]])  # past max_position_embeddings for "dynamic"
    cos, sin = ours(positions, torch.float32)
    their_cos, their_sin = theirs(torch.empty(0), positions)
    torch.testing.assert_close(cos, their_cos, atol=0, rtol=0)
    torch.testing.assert_close(sin, their_sin, atol=0, rtol=0)
    # the forward uses them: the reference with transformers' cos/sin
    noise, context, positions = inputs()
    fresh = TreeFlashDrafterModel.from_pretrained(folder, dtype=torch.float32)  # dynamic RoPE moved above
    with torch.no_grad():
        out = fresh(noise_embeds=noise, context_hidden_states=context, position_ids=positions[None])
        cos_sin = tuple(t[0] for t in Qwen3RotaryEmbedding(Qwen3Config(**source))(torch.empty(0), positions[None]))
    torch.testing.assert_close(out.pre_norm_hidden_state[0],
                               dflash_reference(weights, noise[0], context[0], positions, cos_sin), atol=1e-5,
                               rtol=1e-5)
    # and it survives conversion to our layout
    convert(folder, tmp_path / "ours")
    reloaded = TreeFlashDrafterModel.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert reloaded.config.rope_parameters == model.config.rope_parameters
    torch.testing.assert_close(reloaded.rotary_emb.inv_freq, theirs.original_inv_freq, atol=0, rtol=0)


# ---- sliding-window layers ---------------------------------------------------------------------------------------
WINDOW = 4
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW,
           "use_sliding_window": True}


@pytest.mark.parametrize("is_causal", [None, False])
def test_sliding_layer_masks_the_context_beyond_its_window(tmp_path, is_causal):
    """z-lab's rule: a sliding layer's query at position p sees keys at p - window < k (and k < p + window), and is
    causal unless the config says `is_causal: false`."""
    changes = SLIDING | ({} if is_causal is None else {"is_causal": is_causal})
    folder, weights = zlab_folder(tmp_path / "sliding", changes)
    model = TreeFlashDrafterModel.from_pretrained(folder, dtype=torch.float32)
    assert model.config.layer_types == SLIDING["layer_types"] and model.config.sliding_window == WINDOW
    causal = [is_causal is None, False]
    noise, context, positions = inputs(context_len=9)
    with torch.no_grad():
        out = model(noise_embeds=noise, context_hidden_states=context, position_ids=positions[None])
    reference = dflash_reference(weights, noise[0], context[0], positions, windows=[WINDOW, None], causal=causal)
    torch.testing.assert_close(out.pre_norm_hidden_state[0], reference, atol=1e-5, rtol=1e-5)
    # against full attention over a truncated context: a one-layer sliding drafter's first block query (position 9)
    # sees the context positions 6, 7, 8 only, exactly what full attention sees when only those are given
    one = copy.deepcopy(ZLAB_CONFIG) | {"num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                                        "sliding_window": WINDOW, "use_sliding_window": True, "is_causal": True}
    one_weights = {k: v for k, v in weights.items() if not k.startswith("layers.1.")}
    sliding = TreeFlashDrafterModel.from_pretrained(write_folder(tmp_path / "one", one, one_weights),
                                                    dtype=torch.float32)
    full = TreeFlashDrafterModel.from_pretrained(
        write_folder(tmp_path / "one-full", one | {"layer_types": ["full_attention"], "use_sliding_window": False,
                                                   "sliding_window": None, "is_causal": False}, one_weights),
        dtype=torch.float32)
    with torch.no_grad():
        windowed = sliding(noise_embeds=noise, context_hidden_states=context, position_ids=positions[None])
        truncated = full(noise_embeds=noise[:, :1], context_hidden_states=context[:, 9 - WINDOW + 1:],
                         position_ids=positions[None, 9 - WINDOW + 1: 10])
        changed = context.clone()
        changed[:, : 9 - WINDOW + 1] += 5.0  # outside every block query's window: no effect
        unchanged = sliding(noise_embeds=noise, context_hidden_states=changed, position_ids=positions[None])
    torch.testing.assert_close(windowed.pre_norm_hidden_state[:, 0], truncated.pre_norm_hidden_state[:, 0],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unchanged.pre_norm_hidden_state, windowed.pre_norm_hidden_state, atol=1e-6, rtol=0)


def test_sliding_windows_hold_across_cached_steps_padding_and_sliding_caches(tmp_path):
    """Key positions behind the new context come from the cache's valid slots: two cached steps, a padded row, and
    transformers' own sliding cache layers all give the one-shot result."""
    folder, _ = zlab_folder(tmp_path / "sliding", SLIDING)
    model = TreeFlashDrafterModel.from_pretrained(folder, dtype=torch.float32)
    noise, context, positions = inputs(context_len=9)
    with torch.no_grad():
        once = model(noise_embeds=noise, context_hidden_states=context, position_ids=positions[None])
        # our engine's full-attention cache, and transformers' config-built one (a sliding layer there keeps only its
        # window; past recording lets it crop the block, as transformers' DFlashCache does)
        for cache in (DynamicCache(), DynamicCache(config=model.config)):
            cache.activate_past_recording()
            model(noise_embeds=noise, context_hidden_states=context[:, :8],
                  position_ids=torch.cat([positions[:8], torch.arange(8, 8 + Q)])[None], cache=cache)
            cache.crop(-Q)
            again = model(noise_embeds=noise, context_hidden_states=context[:, 8:], position_ids=positions[None, 8:],
                          cache=cache)
            torch.testing.assert_close(again.pre_norm_hidden_state, once.pre_norm_hidden_state, atol=1e-5, rtol=1e-5)
        assert isinstance(cache.layers[0], DynamicSlidingWindowLayer)
        # a batch whose second row is left-padded by three invalid context slots
        padded_context = torch.cat([torch.zeros(1, 3, 3 * H), context], dim=1)
        batch_context = torch.cat([torch.cat([context, torch.zeros(1, 3, 3 * H)], dim=1), padded_context])
        mask = torch.ones(2, 12 + Q, dtype=torch.long)
        mask[0, 9:12] = 0
        mask[1, :3] = 0
        batch_positions = torch.stack([torch.cat([positions[:9], torch.zeros(3, dtype=torch.long), positions[9:]]),
                                       torch.cat([torch.zeros(3, dtype=torch.long), positions])])
        batch = model(noise_embeds=noise.expand(2, -1, -1), context_hidden_states=batch_context,
                      position_ids=batch_positions, attention_mask=mask)
        for row in range(2):
            torch.testing.assert_close(batch.pre_norm_hidden_state[row], once.pre_norm_hidden_state[0], atol=1e-5,
                                       rtol=1e-5)
        # the same two rows in two cached steps: the invalid slots now sit in the cache, between valid ones
        cache = DynamicCache()
        first = torch.cat([torch.cat([context[:, :6], torch.zeros(1, 3, 3 * H)], 1),
                           torch.cat([torch.zeros(1, 3, 3 * H), context[:, :6]], 1)])
        first_positions = torch.stack([torch.cat([positions[:6], torch.zeros(3, dtype=torch.long)]),
                                       torch.cat([torch.zeros(3, dtype=torch.long), positions[:6]])])
        first_positions = torch.cat([first_positions, torch.arange(6, 6 + Q).expand(2, -1)], 1)
        cached_valid = torch.tensor([[1] * 6 + [0] * 3, [0] * 3 + [1] * 6])
        model(noise_embeds=noise.expand(2, -1, -1), context_hidden_states=first, position_ids=first_positions,
              attention_mask=torch.cat([cached_valid, torch.ones(2, Q, dtype=torch.long)], 1), cache=cache)
        cache.crop(-Q)
        second = model(noise_embeds=noise.expand(2, -1, -1), context_hidden_states=context[:, 6:].expand(2, -1, -1),
                       position_ids=positions[None, 6:].expand(2, -1),
                       attention_mask=torch.cat([cached_valid, torch.ones(2, 3 + Q, dtype=torch.long)], 1),
                       cache=cache)
        for row in range(2):
            torch.testing.assert_close(second.pre_norm_hidden_state[row], once.pre_norm_hidden_state[0], atol=1e-5,
                                       rtol=1e-5)


def test_a_sliding_drafter_decodes_losslessly(tmp_path):
    """The engine keeps every slot (its own full-attention drafter cache) and the drafter masks its windows."""
    folder, _ = zlab_folder(tmp_path / "sliding", SLIDING)
    drafter = TreeFlashDrafterModel.from_pretrained(folder, dtype=torch.float32).eval()
    target = random_target("qwen3", vocab_size=V, hidden_size=H, num_layers=TARGET_LAYERS, num_heads=HEADS,
                           num_kv_heads=KV, seed=3)
    prompts = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])
    plain = target.generate(prompts, max_new_tokens=24, do_sample=False, pad_token_id=0)
    for mode in ("chain", "treeflash"):
        fast = target.generate(prompts, assistant_model=drafter, max_new_tokens=24, do_sample=False, tree_mode=mode,
                               tree_budget=8, pad_token_id=0)
        assert torch.equal(plain, fast), mode


# ---- what cannot be honoured is refused ------------------------------------------------------------------------
REFUSED = {
    "dflash2": ({"architectures": ["DFlash2DraftModel"], "dflash_config": {
        "mask_token_id": MASK, "target_layer_ids": [1, 3, 5], "conv_kernel_size": 2, "selector_rank": 8}}, "DFlash2"),
    "output-multiplier": ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5],
                                             "output_multiplier": 0.2}}, "output_multiplier"),
    "softcapping": ({"final_logit_softcapping": 20.0}, "final_logit_softcapping"),
    "partial-rotary": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5,
                                         "original_max_position_embeddings": 1024}}, "partial_rotary_factor"),
    "sliding-without-window": ({"layer_types": ["sliding_attention", "full_attention"]}, "no sliding window"),
    "unknown-rope": ({"rope_scaling": {"rope_type": "mrope-custom", "factor": 2.0}}, "not supported"),
    "release-ar-type": ({"treeflash_config": {"ar_approximation": "mlp"}}, "ar_approximation='mlp'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_drafter_cannot_compute_is_refused_by_name(tmp_path, case):
    changes, needle = REFUSED[case]
    folder, _ = zlab_folder(tmp_path / case, changes)
    with pytest.raises(ValueError, match=needle):
        TreeFlashDrafterModel.from_pretrained(folder)


def test_unexpected_weights_are_refused_by_name(tmp_path):
    weights = dflash_weights() | {"layers.0.attention_conv.base_kernel": torch.zeros(2, 2, H)}
    folder = write_folder(tmp_path / "extra", ZLAB_CONFIG, weights)
    with pytest.raises(ValueError, match="layers.0.attention_conv.base_kernel"):
        TreeFlashDrafterModel.from_pretrained(folder)


# ---- convert-dflash takes Hub ids ------------------------------------------------------------------------------
def test_convert_dflash_hub_id_offline_is_one_error_line(tmp_path):
    done = run_cli(["convert-dflash", "z-lab/Qwen3-8B-DFlash-b16", tmp_path / "out"], tmp_path)
    line = assert_tool_failure(done, "z-lab/Qwen3-8B-DFlash-b16", "HF_HUB_OFFLINE", "huggingface-cli download")
    assert "No config.json" not in line and not (tmp_path / "out").exists()


def test_training_blocks_keep_the_sliding_windows(tmp_path):
    """Training's flattened forward (one 4D block mask over every anchor's block) gives each block what its own
    forward gives, sliding layers included, so a published sliding drafter can be fine-tuned."""
    from treeflash_hf.training.drafter import block_attention_mask

    folder, _ = zlab_folder(tmp_path / "sliding", SLIDING)
    model = TreeFlashDrafterModel.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    context, noise = torch.randn(1, 12, 3 * H, generator=g), torch.randn(1, 3 * Q, H, generator=g)
    anchors = torch.tensor([[3, 7, 10]])
    positions = torch.cat([torch.arange(12)[None], (anchors[:, :, None] + torch.arange(Q)).reshape(1, -1)], 1)
    with torch.no_grad():
        flat = model(noise_embeds=noise, context_hidden_states=context, position_ids=positions,
                     attention_mask=block_attention_mask(anchors, 12, Q, torch.float32)).pre_norm_hidden_state
        for block, anchor in enumerate(anchors[0].tolist()):
            alone = model(noise_embeds=noise[:, block * Q: (block + 1) * Q], context_hidden_states=context[:, :anchor],
                          position_ids=torch.arange(anchor + Q)[None]).pre_norm_hidden_state
            torch.testing.assert_close(flat[:, block * Q: (block + 1) * Q], alone, atol=1e-5, rtol=1e-5)
