"""The target's forward inside the engine, without transformers' per-call machinery, for decoders laid out like its
Llama (Llama, SmolLM2, Mistral and Qwen2 without sliding windows, Qwen3 with its query/key norms).

A verify step multiplies a few rows by every weight, so the forward's cost past reading the weights is its calls:
on SmolLM2-135M about 1,150 operators and, around them, the modules' Python (decorators, keyword plumbing, the
output-capturing hooks, a module call per norm, attention and MLP). `lean_forward` runs the modeling file's own
operations, in its order, on the model's own modules and weights, from one flat loop: an RMS norm as one call
(`torch.rms_norm` over the float32 input, then the stock cast and weight product), the rotary sine with the sign of
`rotate_half` folded in once per forward (`q * cos + roll(q) * signed_sin`: the same products and sums), the fused
query/key/value and gate/up products (`onednn.FusedProducts`) as views, the attention through the model's own
attention function and masks. Bit for bit the stock forward: checked once per model, its kernels and thread count
(`lean_forward_is_exact`: every logit and hidden state, at a prefill, one token, and a tree) before it is used, else
the model's own forward runs.

`lean_forward_on(model)` switches the model's forward to it for the forwards inside the `with` (the engine's
`kernels.engine_kernels`); a call it does not cover (other arguments, returned attentions, hooks on the modules it
steps over, a model training) goes to the model's own forward; outside, the model runs as loaded (the stock path
stays stock). Not under torch.distributed (every rank would have to take the probe's answer together).

`R` rows, `N` new tokens, `H` / `K` query / key-value heads, `d` head size, `L` layers.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref

import torch
import torch.distributed as dist
from torch.nn.modules import module as torch_module
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep

from .onednn import fused_views, packing_count

LEAN_MODEL_TYPES = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True}  # -> query/key norms
COVERED_ARGUMENTS = {"input_ids", "attention_mask", "position_ids", "cache", "use_cache", "output_hidden_states",
                     "logits_to_keep", "return_dict"}
TRANSFORMERS_HOOKS = "transformers.utils.output_capturing"  # hooks that record what `lean_forward` returns itself
PROBE_PAST, PROBE_TREE = 6, 5  # tokens of the probe's prefill and of its tree


def lean_layout(model) -> list | None:
    """The modules `lean_forward` may step over (their hooks would not run), or None where `model` is not a decoder it
    covers: a causal LM of `LEAN_MODEL_TYPES` with the Llama layout, every layer full attention, its forward the
    class's own (accelerate's dispatch replaces it), outside torch.distributed."""
    config = model.config
    inner = getattr(model, "model", None)
    if (config.model_type not in LEAN_MODEL_TYPES or inner is None or not hasattr(model, "lm_head")
            or "forward" in model.__dict__ or (dist.is_available() and dist.is_initialized())
            or not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb"))
            or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())
            or getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
            or len(inner.layers) != config.num_hidden_layers):
        return None
    query_key_norms = LEAN_MODEL_TYPES[config.model_type]
    stepped_over = [inner, inner.norm]
    for index, layer in enumerate(inner.layers):
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = [(attention, ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")),
                 (mlp, ("gate_proj", "up_proj", "down_proj", "act_fn")),
                 (layer, ("input_layernorm", "post_attention_layernorm"))]
        if query_key_norms:
            parts.append((attention, ("q_norm", "k_norm")))
        if not all(owner is not None and all(hasattr(owner, name) for name in names) for owner, names in parts):
            return None
        if attention.layer_idx != index or getattr(attention, "sliding_window", None) is not None:
            return None
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [attention.q_norm, attention.k_norm] if query_key_norms else []
        if not all(hasattr(norm, "variance_epsilon") and hasattr(norm, "weight") for norm in norms):
            return None
        # (the projections read as one fused product's views are not called either)
        stepped_over += [layer, attention, mlp, *norms, attention.q_proj, attention.k_proj, attention.v_proj,
                         mlp.gate_proj, mlp.up_proj]
    if not hasattr(inner.norm, "variance_epsilon"):
        return None
    return stepped_over


def _foreign_hooks(modules: list) -> bool:
    """Whether a hook other than transformers' own output capturing is on any of `modules`, or a global one."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    for module in modules:
        if module._forward_pre_hooks or any(
                getattr(hook, "__module__", None) != TRANSFORMERS_HOOKS for hook in module._forward_hooks.values()):
            return True
    return False


def rms_norm(norm, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' RMS norm: float32 statistics, cast back, times the weight (`torch.rms_norm` computes the
    float32 part as the stock module does: `x * rsqrt(mean(x ** 2) + eps)`)."""
    normed = torch.rms_norm(hidden.to(torch.float32), (hidden.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * normed.to(hidden.dtype)


def projections(members: tuple, hidden: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of linear layers that read `hidden`: views of one fused product where the engine's fused
    products serve this call (`onednn.fused_views`), else each layer called."""
    views = fused_views(members, hidden)
    return views if views is not None else [member(hidden) for member in members]


def lean_forward(model, stepped_over: list, input_ids: torch.LongTensor, attention_mask=None, position_ids=None,
                 cache=None, output_hidden_states=None, logits_to_keep: int | torch.Tensor = 0):
    """`model`'s forward (`input_ids [R, N]`, a cache) as its modeling file computes it; returns what the model
    returns: `CausalLMOutputWithPast` with the logits, the cache and the hidden states asked for (`[R, N, hidden]`
    at the indices selected, None at the others; the last one after the final norm)."""
    inner = model.model
    config = model.config
    layers = inner.layers
    hidden = inner.embed_tokens(input_ids)
    rows, length = input_ids.shape
    if position_ids is None:
        position_ids = (torch.arange(length, device=hidden.device) + cache.get_seq_length())[None]
    mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                              position_ids=position_ids)
    cos, sin = inner.rotary_emb(hidden, position_ids)  # [R, N, d]
    half = cos.shape[-1] // 2
    cos = cos[:, None]
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]  # rotate_half's sign, once
    attention_function = _attention_function(config, layers[0].self_attn)
    window = {"sliding_window": None} if hasattr(layers[0].self_attn, "sliding_window") else {}  # (as passed)
    count = len(layers) + 1
    if output_hidden_states is True:
        keep = set(range(count))
    elif output_hidden_states is None or output_hidden_states is False:
        keep = set()
    else:
        selected = [output_hidden_states] if isinstance(output_hidden_states, int) else output_hidden_states
        keep = {i % count for i in selected if -count <= i < count}
    states = [hidden if 0 in keep else None]
    query_key_norms = LEAN_MODEL_TYPES[config.model_type]
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        head_dim = attention.head_dim
        normed = rms_norm(layer.input_layernorm, hidden)
        query, key, value = projections((attention.q_proj, attention.k_proj, attention.v_proj), normed)
        query = query.view(rows, length, -1, head_dim)  # [R, N, H, d]
        key = key.view(rows, length, -1, head_dim)
        if query_key_norms:
            query, key = rms_norm(attention.q_norm, query), rms_norm(attention.k_norm, key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)  # [R, H, N, d], [R, K, N, d]
        value = value.view(rows, length, -1, head_dim).transpose(1, 2)
        query = query * cos + query.roll(half, -1) * signed_sin
        key = key * cos + key.roll(half, -1) * signed_sin
        key, value = cache.update(key, value, attention.layer_idx)
        attended, _ = attention_function(attention, query, key, value, mask, dropout=0.0, scaling=attention.scaling,
                                         position_ids=position_ids, **window)
        hidden = hidden + attention.o_proj(attended.reshape(rows, length, -1))
        gate, up = projections((mlp.gate_proj, mlp.up_proj), rms_norm(layer.post_attention_layernorm, hidden))
        hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
        states.append(hidden if len(states) in keep else None)
    hidden = rms_norm(inner.norm, hidden)
    if states[-1] is not None:
        states[-1] = hidden  # (transformers gives the last hidden state after the final norm)
    logits = model.lm_head(slice_logits_to_keep(hidden, logits_to_keep))
    return CausalLMOutputWithPast(logits=logits, cache=cache, hidden_states=tuple(states) if keep else None)


def _attention_function(config, attention):
    """The attention function the model's attention layers call (their modeling file's eager one by default)."""
    eager = sys.modules[type(attention).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)


_EXACT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {(packing, threads, dtype): exact}


@torch.no_grad()
def lean_forward_is_exact(model, stepped_over: list) -> bool:
    """Whether `lean_forward` gives `model`'s own forward bit for bit (every logit and hidden state) on its kernels
    as they are now: random tokens, a prefill, one token, then a tree (a random ancestor mask). Once per model,
    packing of its layers, thread count and dtype."""
    key = (packing_count(), torch.get_num_threads(), model.dtype, model.config._attn_implementation)
    known = _EXACT.setdefault(model, {})
    if key in known:
        return known[key]
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    device = model.device
    past = torch.randint(0, vocab, (1, PROBE_PAST), generator=generator).to(device)
    token = torch.randint(0, vocab, (1, 1), generator=generator).to(device)
    tree = torch.randint(0, vocab, (1, PROBE_TREE), generator=generator).to(device)
    allowed = torch.ones(1, PROBE_TREE, PROBE_PAST + 1 + PROBE_TREE, dtype=torch.bool)
    allowed[0, :, -PROBE_TREE:] = (torch.rand(PROBE_TREE, PROBE_TREE, generator=generator) < 0.5).tril()
    allowed[0, :, -PROBE_TREE:].fill_diagonal_(True)
    tree_mask = torch.zeros((), dtype=model.dtype).masked_fill(~allowed, torch.finfo(model.dtype).min)[:, None]
    calls = [dict(input_ids=past), dict(input_ids=token),
             dict(input_ids=tree, attention_mask=tree_mask.to(device),
                  position_ids=torch.arange(PROBE_PAST + 1, PROBE_PAST + 1 + PROBE_TREE, device=device)[None])]
    stock_cache, lean_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
    exact = True
    for call in calls:
        stock = type(model).forward(model, **call, cache=stock_cache, use_cache=True, output_hidden_states=True)
        lean = lean_forward(model, stepped_over, **call, cache=lean_cache, output_hidden_states=True)
        exact = exact and torch.equal(stock.logits, lean.logits) and len(stock.hidden_states) == len(
            lean.hidden_states) and all(torch.equal(a, b) for a, b in zip(stock.hidden_states, lean.hidden_states))
    known[key] = exact
    return exact


_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (the config's id, lean_layout)
_SWITCHED = threading.Lock()
_DEPTH: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> `lean_forward_on` blocks open


def _layout(model) -> list | None:
    kept = _LAYOUTS.get(model)
    if kept is None or kept[0] != id(model.config):
        kept = (id(model.config), lean_layout(model))
        _LAYOUTS[model] = kept
    return kept[1]


def lean_forward_applies(model) -> bool:
    """Whether `lean_forward_on` switches `model` (a covered layout whose lean forward is exact on its kernels)."""
    stepped_over = _layout(model)
    return stepped_over is not None and lean_forward_is_exact(model, stepped_over)


def _covered(model, stepped_over: list, kwargs: dict) -> bool:
    input_ids = kwargs.get("input_ids")
    return (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not model.training
            and isinstance(kwargs.get("cache"), DynamicCache) and COVERED_ARGUMENTS.issuperset(kwargs)
            and kwargs.get("use_cache", True) is not False and kwargs.get("return_dict", True) is not False
            and not _foreign_hooks(stepped_over))


@contextlib.contextmanager
def lean_forward_on(model):
    """`model`'s forwards inside the `with` through `lean_forward` where it applies and covers the call; the model's
    own forward comes back on leaving (an exception included; nested blocks leave it on until the outermost)."""
    stepped_over = _layout(model)
    if stepped_over is None or not lean_forward_is_exact(model, stepped_over):
        yield
        return
    stock = type(model).forward

    def forward(*args, **kwargs):
        if len(args) == 1 and "input_ids" not in kwargs:  # (the models covered take `input_ids` first)
            args, kwargs = (), {"input_ids": args[0], **kwargs}
        if args or not _covered(model, stepped_over, kwargs):
            return stock(model, *args, **kwargs)
        kwargs.pop("use_cache", None)
        kwargs.pop("return_dict", None)
        return lean_forward(model, stepped_over, **kwargs)

    with _SWITCHED:
        depth = _DEPTH.get(model, 0)
        if depth == 0:
            model.forward = forward
        _DEPTH[model] = depth + 1
    try:
        yield
    finally:
        with _SWITCHED:
            _DEPTH[model] -= 1
            if _DEPTH[model] == 0:
                del model.__dict__["forward"]
