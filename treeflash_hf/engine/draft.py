"""The draft step of the pipeline (draft -> tree -> verify -> accept -> commit): one drafter forward, then the
tables the tree is built from. "Stage 1" and "stage 2" below are the paper's two tree stages (the top-M tokens of
each marginal; the AR-corrected rows over them), not pipeline steps.

`Q` block size, `D` deepest drafted depth (<= Q-1), `V` vocabulary, `H` hidden size, `M` top-m, `K` top-k,
`n` number of context layers, `L` drafter-cache length, `C` shortlist size of stage 2, `V'` size of the draft vocabulary (V without one).
"""

from __future__ import annotations

import functools
import itertools
import time
import weakref
from dataclasses import dataclass

import torch

from .answer_store import BUILD_COMMAND, answer_store_of
from .cache import drafter_cache, repack, select_rows, valid_or_all
from .lookup import with_lookup_branch
from .onednn import pack_weight, packable_dtypes, packed_product
from .options import TreeOptions
from .trace import DRAFT, DRAFTER_FORWARD, TREE, record_function, traced
from .tree import ChildList, DraftTree, TreeBatch, best_first_tree, best_first_trees, chain_tree, table_children
from .validation import TreeFlashInputError
from .verify import same_logits


@dataclass
class Shortlist:
    """Per depth d = 1..D, the `C` most likely tokens of the marginal and the marginal's log-mass on them. Stage 2
    scores AR rows on these tokens only (`C*H` instead of `V*H` per row) and gives the shortlist the marginal's
    mass: with a zero AR layer that reproduces the marginal exactly.

    tokens: `[D, C]` sorted by decreasing marginal probability; log_mass: `[D]`."""

    tokens: torch.LongTensor
    log_mass: torch.Tensor


@dataclass
class BlockDraft:
    """One row of a drafter forward. anchor_token: `b`; prev_token: the committed token before `b` (or -1);
    pre_norm_hidden: `[D'+1, H]` backbone outputs for slots 0..D' (every drafted depth); marginal_log_probs:
    `[D, V']` for the depths 1..D scored so far (D <= D'), over the draft vocabulary (`V'` = V without one; see
    `TreeDrafter.column_tokens`); shortlist: the stage-2 vocabulary per scored depth, or None
    for the full vocabulary; unscored_hidden: `[D'-D, H]` the normed outputs of the depths not scored yet (None:
    none left; `TreeDrafter.score_deeper` scores them)."""

    anchor_token: int
    prev_token: int
    pre_norm_hidden: torch.Tensor
    marginal_log_probs: torch.Tensor
    shortlist: Shortlist | None = None
    unscored_hidden: torch.Tensor | None = None

    @property
    def depth(self) -> int:
        return int(self.marginal_log_probs.shape[0])


@dataclass
class DraftContext:
    """Target context features the drafter has not seen yet, one padded row per batch row.

    features: `[R, L, n*H]`; positions: `[R, L]` their positions; valid: `[R, L]` false for padding (None: all
    valid)."""

    features: torch.Tensor
    positions: torch.LongTensor
    valid: torch.BoolTensor | None = None


@dataclass
class ARTable:
    """Stage 2 for one row's top tree: `child_tokens` / `child_log_probs` `[D, M, K]`, entry `[d, j]` = the top-K
    children (depth d+1) of the j-th parent at depth d: the root for d = 0 (j = 0 only), the token `top[d, j]` of
    `S_d` for d >= 1. top: `[D, M]` (row 0 holds the anchor)."""

    child_tokens: torch.LongTensor
    child_log_probs: torch.Tensor
    top: torch.LongTensor

    def children(self):
        """`children_of(depth, token)` for the best-first search (None: a leaf, no AR row)."""
        tokens, log_probs = self.child_tokens.tolist(), self.child_log_probs.float().tolist()
        index = [{token: j for j, token in enumerate(row)} for row in self.top.tolist()]
        index[0] = {self.top[0, 0].item(): 0}

        def children_of(depth: int, token: int) -> ChildList | None:
            if depth >= len(index):
                return None
            j = 0 if depth == 0 else index[depth].get(token, -1)
            return None if j < 0 else (tokens[depth][j], log_probs[depth][j])

        return children_of


@dataclass
class HeadRows:
    """The head's rows of a draft vocabulary `token_ids [V']` (None: the whole head), kept by `TargetHead.weight_rows`
    while the ids (by reference and `version`) stay the same: `weight [V', H]`, `bias [V']` or None, and `packed`, their
    oneDNN-packed copy when the target's head runs packed, else None."""

    token_ids: torch.LongTensor | None
    version: int
    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None


@dataclass
class StageTwoInputs:
    """What stage 2 reads of the rows of one draft, stacked once per tree step.

    hidden: `[R, D'+1, H]` the backbone outputs before the final norm (slot d + 1 is corrected for the children of
    a depth-d parent); shortlist_tokens `[R, D, C]` and log_mass `[R, D]`: the rows' shortlists (None: the full
    vocabulary); prev2_tokens: `[R, D+2]`, entry d the token two back of a depth-d parent (None: an AR layer that
    reads one previous token)."""

    hidden: torch.Tensor
    shortlist_tokens: torch.LongTensor | None
    log_mass: torch.Tensor | None
    prev2_tokens: torch.LongTensor | None


def draft_vocabulary(drafter) -> torch.LongTensor | None:
    """The drafter's draft vocabulary `draft_token_ids [V']` (None: it drafts from every token), checked: a
    corrupt one would draft tokens the target does not have."""
    token_ids = getattr(drafter, "draft_token_ids", None)
    if token_ids is None:
        return None
    vocab_size = drafter.config.vocab_size
    if (token_ids.dim() != 1 or token_ids.dtype != torch.long or token_ids.numel() == 0
            or int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size
            or token_ids.unique().numel() != token_ids.numel()):
        raise TreeFlashInputError(
            f"The drafter's draft vocabulary (`draft_token_ids`, {token_ids.numel()} ids) is not a list of distinct "
            f"token ids below its vocab_size {vocab_size}: the checkpoint is corrupt. Re-download or re-export "
            "the drafter, or call `drafter.set_draft_vocab(None)` to draft from the whole vocabulary."
        )
    return token_ids


def full_tensor(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor-parallel (DTensor) weight gathered into one plain tensor; any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def is_plain_linear(module) -> bool:
    """An `nn.Linear` itself (not a subclass) with a plain or tensor-parallel weight: its output is
    `hidden @ weight.T + bias`."""
    weight = getattr(module, "weight", None)
    plain = type(weight) in (torch.Tensor, torch.nn.Parameter) or hasattr(weight, "full_tensor")
    return type(module) is torch.nn.Linear and plain


def dense_weight_candidate(module) -> torch.Tensor | None:
    """A dense `[V, H]` candidate for the weight of a head that is not a plain Linear, or None: HQQ's
    `HQQLinear.dequantize()`, a torchao or optimum-quanto weight's `.dequantize()`, a plain weight as it is. Only a
    candidate: some `.dequantize()`s return something else (bitsandbytes' packed parameters), so it is checked."""
    try:
        if hasattr(module, "dequantize"):
            return module.dequantize()
        weight = getattr(module, "weight", None)
        if weight is None or type(weight) in (torch.Tensor, torch.nn.Parameter):
            return weight
        return weight.dequantize()
    except Exception:  # no dense form this way: the head is called instead
        return None


# A float32 head of at least this many elements (16 MB) is worth a measured bfloat16 copy for drafting on a CPU.
FAST_COPY_MIN_ELEMENTS = 4 * 2**20
MIN_AR_SHORTLIST = 64  # stage-2 candidates per depth on a CPU when M is smaller (a C*H product per AR row)
CPU_CALL_MACS = 3e7  # a CPU module call's fixed cost, in multiply-adds of work (docs/design.md)
LAZY_CALLS = 3  # calls (rounds) of a lazy stage 2 per tree step, and the AR rows it computes per tree node
LAZY_ROWS_PER_NODE = 2  # (measured about 2.6-2.9 and 1.6-1.7 on the SmolLM2 pair, docs/design.md)
SCORED_ROWS = 16  # rows of a typical drafting product with the head: one block's depths, or a few rows' worth
TIMED_HEAD_ROWS = 16384  # head rows the dtype comparison multiplies (the product's cost is linear in them)


@functools.lru_cache(maxsize=None)
def bfloat16_product_is_faster(hidden_size: int, threads: int) -> bool:
    """Whether, on this CPU with `threads` threads, `[SCORED_ROWS, H] @ [TIMED_HEAD_ROWS, H].T` runs faster in
    bfloat16 than in float32 (measured once per hidden size and thread count: CPUs with bfloat16 matrix units run
    it several times faster, others slower). A fact of the machine, so kept for the process."""
    def seconds(dtype: torch.dtype) -> float:
        weight = torch.randn(TIMED_HEAD_ROWS, hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
        hidden = torch.randn(SCORED_ROWS, hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
        hidden @ weight.T  # warm-up
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            hidden @ weight.T
            best = min(best, time.perf_counter() - start)
        return best

    return seconds(torch.bfloat16) < 0.8 * seconds(torch.float32)


def tensor_identity(tensor: torch.Tensor) -> tuple:
    """What tells a tensor's contents changed: `.to()`, `.half()` or `.data = ...` keep a parameter's id and
    version, not its storage, dtype or shape (a wrapper subclass without storage, e.g. a quantized weight, has no
    data pointer)."""
    try:
        pointer = tensor.data_ptr()
    except RuntimeError:
        pointer = None
    return id(tensor), tensor._version, pointer, tensor.dtype, str(tensor.device), tuple(tensor.shape)


# lm_head -> (identity of its tensors, its TargetHead): nothing is set on the user's module
_TARGET_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class TargetHead:
    """The target's output head as the drafting side uses it: `logits` of hidden states, and `shortlist_logits` on
    chosen tokens (the CPU shortlist, see `Shortlist`).

    A plain `nn.Linear` head (a tensor-parallel one gathered once) is used through its weight, so that the
    shortlist reads `C` rows of it instead of all `V`. Any other head (a quantized Linear of torchao, bitsandbytes
    or optimum-quanto, HQQ's `HQQLinear`, ...) is dequantized once into a dense weight when that reproduces the
    head's own outputs, and else called as a module (the shortlist then takes its tokens from the full logits).
    Drafts are scored as the target's head scores them either way; losslessness never depends on it (the target
    verifies every token). On a CPU a large float32 weight is copied to bfloat16 when that product is measured
    faster (`bfloat16_product_is_faster`; CPUs with bfloat16 matrix units gain several times, see docs/design.md):
    drafts are then scored in bfloat16, as they are for a bfloat16 target.

    weight: `[V, H]` on the drafter's device, or None when the head is called; bias: `[V]` or None."""

    def __init__(self, lm_head, hidden_size: int, device: torch.device, dtype: torch.dtype):
        if lm_head is None:
            raise TreeFlashInputError(
                "The target has no output head (`get_output_embeddings()` is None): TreeFlash scores its drafts "
                "with the target's lm_head. Use a causal-LM class of the target (`AutoModelForCausalLM`)."
            )
        self.module, self.device = lm_head, device
        stored = next(itertools.chain(lm_head.parameters(), lm_head.buffers()), None)
        self.module_device = device if stored is None else stored.device  # where the head takes its inputs
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.kept_rows: HeadRows | None = None
        if is_plain_linear(lm_head):
            # plain tensors: the drafter side indexes rows and must not take part in the target's collectives
            self.weight = full_tensor(lm_head.weight).to(device)
            self.bias = None if lm_head.bias is None else full_tensor(lm_head.bias).to(device)
            if not hasattr(lm_head.weight, "full_tensor"):  # (tensor parallel: every rank must draft alike, and
                self.use_faster_copy()                       # a measurement per rank could differ)
            return
        # The first call: the head must take drafter hidden states, and a dense copy must give what it gives.
        probe = torch.randn(4, hidden_size, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        with torch.no_grad():
            reference = self.call(probe)  # [4, V]
        self.vocab_size = reference.shape[-1]
        weight = dense_weight_candidate(lm_head)
        if weight is None or tuple(weight.shape) != (self.vocab_size, hidden_size):
            return
        weight = weight.to(device, dtype)
        bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.to(device, dtype)
        with torch.no_grad():
            dense = probe @ weight.T if bias is None else probe @ weight.T + bias
        if same_logits(dense, reference, dtype):
            self.weight, self.bias = weight, bias
            self.use_faster_copy()

    def use_faster_copy(self) -> None:
        """Score with a bfloat16 copy of a large float32 weight on a CPU where that product is faster."""
        weight = self.weight
        if self.device.type != "cpu" or weight.dtype != torch.float32 or weight.numel() < FAST_COPY_MIN_ELEMENTS:
            return
        if bfloat16_product_is_faster(weight.shape[1], torch.get_num_threads()):
            self.weight = weight.to(torch.bfloat16)
            self.bias = None if self.bias is None else self.bias.to(torch.bfloat16)

    @classmethod
    def of(cls, lm_head, hidden_size: int, device: torch.device, dtype: torch.dtype) -> "TargetHead":
        """The `TargetHead` of `lm_head`, made once and kept (beside the module, freed with it) for later calls while its
        tensors stay the same (dequantizing and checking a quantized head, or copying a plain one to bfloat16,
        costs more than a decoding step)."""
        if lm_head is None:
            return cls(lm_head, hidden_size, device, dtype)
        tensors = itertools.chain(lm_head.parameters(), lm_head.buffers())
        kernels = (type(lm_head), getattr(lm_head, "packed_rows_hint", None), getattr(lm_head, "stock_max_rows", None))
        key = (hidden_size, str(device), dtype, kernels, tuple(tensor_identity(t) for t in tensors))
        kept = _TARGET_HEADS.get(lm_head)
        if kept is None or kept[0] != key:
            kept = (key, cls(lm_head, hidden_size, device, dtype))
            _TARGET_HEADS[lm_head] = kept
        return kept[1]

    def call(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head module itself on `hidden [..., H]` -> `[..., V]` on the drafter's device. A head that cannot
        take drafter hidden states is an input error (found by the first call, in `__init__`)."""
        if hidden.numel() == 0:  # (no depth left to draft) some kernels fail on empty inputs
            return hidden.new_zeros(hidden.shape[:-1] + (self.vocab_size,))
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.module_device)  # some kernels take 2-D inputs only
        try:
            logits = self.module(flat)
            if logits.dim() != 2 or logits.shape[0] != flat.shape[0]:
                raise ValueError(f"it returned shape {tuple(logits.shape)} for input shape {tuple(flat.shape)}")
        except Exception as err:
            weight = getattr(self.module, "weight", None)
            name = f"{type(self.module).__module__}.{type(self.module).__qualname__}"
            if weight is not None and type(weight) not in (torch.Tensor, torch.nn.Parameter):
                name += f" with a {type(weight).__module__}.{type(weight).__qualname__} weight"
            raise TreeFlashInputError(
                f"TreeFlash scores its drafts with the target's output head, and this target's head ({name}) "
                f"cannot be called on hidden states ({type(err).__name__}: {str(err)[:300]}). Load the target "
                "with its head left unquantized (e.g. add 'lm_head' to the quantization config's "
                "`modules_to_not_convert`, or to `llm_int8_skip_modules` for bitsandbytes)."
            ) from None
        return logits.to(self.device).view(*hidden.shape[:-1], logits.shape[-1])

    def logits(self, hidden: torch.Tensor, token_ids: torch.LongTensor | None = None) -> torch.Tensor:
        """`hidden [..., H]` -> logits `[..., V]`, or `[..., V']` on the tokens `token_ids [V']` only (a draft
        vocabulary: the product reads those head flat only)."""
        if self.weight is None:
            logits = self.call(hidden)
            return logits if token_ids is None else logits.index_select(-1, token_ids.to(logits.device))
        rows = HeadRows(None, 0, self.weight, self.bias, None) if token_ids is None else self.weight_rows(token_ids)
        # as contiguous 2-D flat: a 3-D input converted from float32 keeps its slice's batch stride, a layout the
        # CPU's bfloat16 product handles many times slower
        flat = hidden.reshape(-1, hidden.shape[-1]).to(rows.weight.dtype)
        if rows.packed is not None and flat.shape[0] > self.module.stock_max_rows:
            logits = packed_product(flat, rows.packed, rows.bias)
        elif rows.bias is None:
            logits = flat @ rows.weight.T
        else:
            logits = torch.addmm(rows.bias, flat, rows.weight.T)
        return logits.to(hidden.dtype).view(*hidden.shape[:-1], logits.shape[-1])

    def weight_rows(self, token_ids: torch.LongTensor) -> HeadRows:
        """The head's `HeadRows` of `token_ids`, gathered once into a contiguous matrix and kept while the ids stay the
        same (a small matrix stays in the CPU's cache; the full one does not), packed when the target's head runs
        packed (`runs_packed`)."""
        kept = self.kept_rows  # (kept by reference: a freed tensor's id and memory can be reused by new ids)
        if kept is None or kept.token_ids is not token_ids or kept.version != token_ids._version:
            index = token_ids.to(self.weight.device)
            weight = self.weight[index].contiguous()
            packed = pack_weight(weight, self.module.packed_rows_hint) if self.runs_packed(weight) else None
            kept = HeadRows(token_ids, token_ids._version, weight, None if self.bias is None else self.bias[index],
                            packed)
            self.kept_rows = kept
        return kept

    def runs_packed(self, weight: torch.Tensor) -> bool:
        """Whether the target's head multiplies through oneDNN's packed weights (`integrations/cpu_linear.py`, where
        that was timed faster on this CPU), so that rows of `weight` are scored the same way: on a CPU, in a dtype
        oneDNN multiplies, the bias (if any) in the weight's dtype."""
        return (hasattr(self.module, "packed_rows_hint") and weight.device.type == "cpu"
                and weight.dtype in packable_dtypes() and (self.bias is None or self.bias.dtype == weight.dtype))

    def shortlist_logits(self, hidden: torch.Tensor, tokens: torch.LongTensor) -> torch.Tensor:
        """Logits of groups of rows `hidden [..., G, H]` on their group's tokens `tokens [..., C]` (the same leading
        shape `...`) -> `[..., G, C]`."""
        if self.weight is None:  # a called head scores every token: keep the shortlist's
            logits = self.call(hidden)
            return logits.gather(-1, tokens[..., None, :].expand(logits.shape[:-1] + tokens.shape[-1:]))
        groups = hidden.reshape(-1, *hidden.shape[-2:]).to(self.weight.dtype)  # [B, G, H] (see `logits`)
        flat_tokens = tokens.reshape(-1)  # (`index_select`: a CPU gathers rows several times faster than by `[]`)
        head_rows = self.weight.index_select(0, flat_tokens).view(-1, tokens.shape[-1], self.weight.shape[-1])
        logits = torch.bmm(groups, head_rows.transpose(-1, -2))  # [B, G, C]
        if self.bias is not None:
            logits = logits + self.bias.index_select(0, flat_tokens).view(-1, 1, tokens.shape[-1])
        return logits.to(hidden.dtype).view(*hidden.shape[:-1], tokens.shape[-1])


class TreeDrafter:
    """The drafting side of TreeFlash: keeps the drafter's context cache, drafts a block per row, builds trees.

    The decode loop calls `draft` -> `build_trees` -> (target verifies) -> `draft` again with the accepted
    positions' context features. Rows are batch rows: every call handles all rows of the working batch at once.
    (`integrations.candidate_generator.TreeDrafter` adds transformers' `CandidateGenerator`
    protocol on top.)
    """

    def __init__(self, drafter, target, options: TreeOptions, ar_evaluation: str | None = None):
        self.drafter = drafter
        self.options = options
        self.input_embeddings = target.get_input_embeddings()
        config = drafter.config
        self.head = TargetHead.of(target.get_output_embeddings(), config.hidden_size, drafter.device, drafter.dtype)
        # The draft vocabulary (`draft_token_ids [V']`, None: every token): marginals and full-vocabulary AR rows
        # are scored on these head rows only, so their columns are positions in it (`column_tokens` maps them).
        self.draft_vocab = draft_vocabulary(drafter)
        if self.draft_vocab is not None:
            self.draft_vocab = self.draft_vocab.to(drafter.device)
        self.target_layer_ids = list(config.target_layer_ids)
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.two_prev_tokens = config.ar_num_prev_tokens == 2
        self.cache = drafter_cache(config)
        self.key_valid: torch.BoolTensor | None = None  # [R, L] valid drafter-cache slots (None: all valid)
        # How stage 2 runs (the same tree either way): "batched" evaluates every (depth, top-M token) row of every
        # batch row in one call (about M*Q rows each); "lazy" evaluates only the rows of nodes the best-first
        # searches expand, in a few calls (`lazy_trees`). "auto" picks lazy when its calls cost less than the
        # batched rows, counting one call as `call_cost_in_rows` rows: on a CPU a call's fixed cost
        # (CPU_CALL_MACS multiply-adds' worth) over one row's AR-layer multiply-adds; effectively infinite on a
        # GPU, where one big batch is nearly free.
        self.ar_evaluation = ar_evaluation or "auto"
        ar_layer = drafter.ar_approximation
        row_macs = ar_layer.ug.weight.numel() + ar_layer.d.weight.numel()
        self.call_cost_in_rows = CPU_CALL_MACS / row_macs if drafter.device.type == "cpu" else float("inf")
        # Stage-2 vocabulary: AR rows are scored on the marginal's top `ar_shortlist` tokens of their depth (see
        # `Shortlist`), at least the M tokens per depth that the top tree may expand, so that every node of the tree
        # can have children. On a CPU a full-vocabulary row costs a V*H product (the whole lm_head read per call);
        # on an accelerator it is nearly free, and None (the full vocabulary) is kept while the M*D' rows stay few.
        top_m = options.tree_top_m
        on_cpu = drafter.device.type == "cpu"
        self.ar_shortlist: int | None = max(top_m, MIN_AR_SHORTLIST) if on_cpu or top_m > MIN_AR_SHORTLIST else None
        self.device = drafter.device  # read once: a model's `device` property walks its parameters
        # The lookup branch's second source: the target's earlier answers (`answer_store.py`), when the drafter has
        # a store and the branch is on.
        self.answer_store = answer_store_of(drafter) if options.tree_lookup else None
        vocab_size = target.config.get_text_config().vocab_size
        if self.answer_store is not None and self.answer_store.vocab_size > vocab_size:  # (a padded vocabulary: more)
            raise TreeFlashInputError(
                f"The drafter's answer store was built for a vocabulary of {self.answer_store.vocab_size} tokens, "
                f"more than this target's {vocab_size}: rebuild it from this target's answers (`{BUILD_COMMAND}`) "
                "or detach it (`attach_answer_store(drafter, None)`).")
        # transformers' assisted loop merges this into the target's forward kwargs.
        self.model_kwargs_overrides = {"output_hidden_states": [i + 1 for i in self.target_layer_ids]}

    # ---- pipeline pieces -------------------------------------------------------------------------------
    def embed(self, token_ids: torch.LongTensor) -> torch.Tensor:
        """The target's input embeddings of `token_ids`, on the drafter's device (a target split over devices
        keeps its embedding table wherever its first layers are)."""
        return self.input_embeddings(token_ids).to(self.device)

    def draft_log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafting distributions of normed drafter outputs `[..., H]`: log-probs `[..., V']` over the draft
        vocabulary (`[..., V]` without one)."""
        return torch.log_softmax(self.head.logits(hidden, self.draft_vocab).float(), dim=-1)

    def column_tokens(self, columns: torch.LongTensor) -> torch.LongTensor:
        """Token ids of columns of `draft_log_probs` (any shape)."""
        return columns if self.draft_vocab is None else self.draft_vocab[columns]

    def full_vocabulary(self, log_probs: torch.Tensor) -> torch.Tensor:
        """`draft_log_probs` `[..., V']` laid out over the whole vocabulary `[..., V]` (-inf off the draft
        vocabulary), for callers that index by token id."""
        if self.draft_vocab is None:
            return log_probs
        full = log_probs.new_full((*log_probs.shape[:-1], self.drafter.config.vocab_size), -float("inf"))
        return full.index_copy_(-1, self.draft_vocab, log_probs)

    def context_features(self, hidden_states: tuple, positions: torch.LongTensor | slice) -> torch.Tensor:
        """Concatenate the target-layer outputs (each gathered to the drafter's device, wherever its layer runs) at
        `positions`: a slice of the sequence axis, or `[R, K]` per-row indices. Returns `[R, L or K, n*H]`."""
        layers = [hidden_states[i + 1].to(self.device) for i in self.target_layer_ids]
        if isinstance(positions, slice):
            return torch.cat([layer[:, positions] for layer in layers], dim=-1)
        index = positions.to(self.device)[..., None].expand(-1, -1, layers[0].shape[-1])
        return torch.cat([layer.gather(1, index) for layer in layers], dim=-1)

    @torch.no_grad()
    @traced(DRAFT)
    def draft(
        self,
        anchor_tokens: list[int],
        anchor_positions: torch.LongTensor,
        context: DraftContext,
        max_depth: int,
        prev_tokens: list[int] | None = None,
        scored_depth: int | None = None,
    ) -> list[BlockDraft]:
        """One drafter forward for every row: append `context` to the drafter cache and draft the block anchored at
        `anchor_tokens[r]` (position `anchor_positions[r]`) down to depth `max_depth`. Depths `1..scored_depth`
        (None: all) get their marginals from the target's head now, the rest only if `score_deeper` asks: the
        full-vocabulary product is most of a draft's cost, and most trees stop a few depths down."""
        device = self.device
        num_rows, q_len = len(anchor_tokens), self.block_size
        noise_ids = torch.full((num_rows, q_len), self.mask_token_id, dtype=torch.long, device=device)
        noise_ids[:, 0] = torch.tensor(anchor_tokens, device=device)
        block_positions = anchor_positions[:, None] + torch.arange(q_len)  # [R, Q]
        position_ids = torch.cat([context.positions, block_positions], dim=1).to(device)
        new_valid = context.valid
        if self.key_valid is None and new_valid is None:
            attention_mask = None  # every key valid: no mask
        else:
            num_context = context.features.shape[1]
            old = valid_or_all(self.key_valid, num_rows, self.cache.get_seq_length())
            new = valid_or_all(new_valid, num_rows, num_context)
            self.key_valid = torch.cat([old.cpu(), new.cpu()], dim=1)
            attention_mask = torch.cat([self.key_valid, torch.ones(num_rows, q_len, dtype=torch.bool)], dim=1).to(device)
        with record_function(DRAFTER_FORWARD):
            out = self.drafter(
                noise_embeds=self.embed(noise_ids),
                context_hidden_states=context.features.to(device),
                position_ids=position_ids,
                attention_mask=attention_mask,
                cache=self.cache,
            )
        self.cache.crop(-q_len)  # keep the context K/V, drop the block's
        depth = max(0, min(q_len - 1, max_depth))
        scored = depth if scored_depth is None else max(0, min(depth, scored_depth))
        marginal_log_probs, shortlists = self.marginals(out.last_hidden_state[:, 1 : scored + 1])
        unscored = out.last_hidden_state[:, scored + 1 : depth + 1] if scored < depth else None  # [R, D'-D, H]
        prev_tokens = prev_tokens or [-1] * num_rows
        rows = zip(anchor_tokens, prev_tokens, out.pre_norm_hidden_state[:, : depth + 1].unbind(),
                   marginal_log_probs.unbind(), shortlists or [None] * num_rows,
                   [None] * num_rows if unscored is None else unscored.unbind())
        return [BlockDraft(*row) for row in rows]

    def marginals(self, hidden: torch.Tensor) -> tuple[torch.Tensor, list[Shortlist] | None]:
        """Normed drafter outputs `[R, D, H]` -> the marginals' log-probs `[R, D, V']` (columns: the draft
        vocabulary) and each row's shortlist."""
        marginal_log_probs = self.draft_log_probs(hidden)
        shortlists = self.shortlists(marginal_log_probs) if self.options.tree_mode == "treeflash" else None
        return marginal_log_probs, shortlists

    def score_deeper(self, blocks: list[BlockDraft]) -> None:
        """Score the depths `draft` left unscored (every row's, in one product), appending them to each block."""
        if blocks[0].unscored_hidden is None:
            return
        marginal_log_probs, shortlists = self.marginals(torch.stack([block.unscored_hidden for block in blocks]))
        joined = torch.cat([torch.stack([block.marginal_log_probs for block in blocks]), marginal_log_probs], dim=1)
        if shortlists is not None and blocks[0].shortlist is not None:
            tokens = torch.cat([torch.stack([block.shortlist.tokens for block in blocks]),
                                torch.stack([shortlist.tokens for shortlist in shortlists])], dim=1)
            log_mass = torch.cat([torch.stack([block.shortlist.log_mass for block in blocks]),
                                  torch.stack([shortlist.log_mass for shortlist in shortlists])], dim=1)
            for block, row_tokens, row_mass in zip(blocks, tokens.unbind(), log_mass.unbind()):
                block.shortlist = Shortlist(row_tokens, row_mass)
        for block, row_log_probs in zip(blocks, joined.unbind()):
            block.marginal_log_probs = row_log_probs
            block.unscored_hidden = None

    @staticmethod
    def search_stopped_at_scored_depth(blocks: list[BlockDraft], deepest: int) -> bool:
        """Whether the trees' deepest node (`deepest`, over every row) is at the deepest scored depth while deeper
        ones wait unscored: only then could scoring them change a tree (a best-first search never reaches a depth
        without a node just above)."""
        return blocks[0].unscored_hidden is not None and deepest >= blocks[0].depth

    def shortlists(self, marginal_log_probs: torch.Tensor) -> list[Shortlist] | None:
        """The stage-2 `Shortlist` of each row of marginals `[R, D, V']`, or None when rows score the full
        (draft) vocabulary."""
        size = self.ar_shortlist
        if size is None or size >= marginal_log_probs.shape[-1] or marginal_log_probs.shape[1] == 0:
            return None
        top = marginal_log_probs.topk(size, dim=-1)  # [R, D, C], sorted
        log_mass = torch.logsumexp(top.values, dim=-1)  # [R, D]
        return [Shortlist(tokens, mass) for tokens, mass in zip(self.column_tokens(top.indices).unbind(),
                                                                log_mass.unbind())]

    def select_rows(self, row_index: torch.LongTensor) -> None:
        """Keep only the rows `row_index` of the drafter cache (finished rows leave the batch)."""
        select_rows(self.cache, row_index)
        if self.key_valid is not None:
            self.key_valid = self.key_valid[row_index.cpu()]

    def add_rows(self, count: int) -> None:
        """Continuous batching: `count` new rows join the batch. Their drafter-cache slots are invalid (zeros): their
        prompts arrive as context with the next draft."""
        length = self.cache.get_seq_length()
        if length == 0:
            return  # nothing cached yet: the next draft brings every row's context
        num_rows = int(self.cache.layers[0].keys.shape[0])
        for layer in self.cache.layers:
            if layer.keys is not None and layer.keys.numel():
                shape = (count, *layer.keys.shape[1:])
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(shape)])
                layer.values = torch.cat([layer.values, layer.values.new_zeros(shape)])
        self.key_valid = torch.cat([valid_or_all(self.key_valid, num_rows, length),
                                    torch.zeros(count, length, dtype=torch.bool)])

    def reset(self) -> None:
        """Forget every row (the working batch emptied): the next draft starts a fresh drafter cache."""
        self.cache = drafter_cache(self.drafter.config)
        self.key_valid = None

    def repack(self, valid_counts: list[int] | None = None) -> None:
        """Re-pack the drafter cache when invalid slots pile up (see `cache.repack`; `valid_counts`: each row's
        valid slots, kept by the caller)."""
        self.key_valid = repack(self.cache, self.key_valid, valid_counts=valid_counts)

    def top_tokens(self, block: BlockDraft) -> torch.LongTensor:
        """Stage 1: `S_d`, the top-M tokens of each marginal, `[D, M]` for depths 1..D."""
        top_m = min(self.options.tree_top_m, block.marginal_log_probs.shape[-1])
        if block.shortlist is not None and block.shortlist.tokens.shape[-1] >= top_m:
            return block.shortlist.tokens[:, :top_m]
        return self.column_tokens(block.marginal_log_probs.topk(top_m, dim=-1).indices)

    def top_tokens_of_rows(self, blocks: list[BlockDraft]) -> torch.LongTensor:
        """`top_tokens` of every row at once, `[R, D, M]` (rows of one draft: the same depths)."""
        top_m = min(self.options.tree_top_m, blocks[0].marginal_log_probs.shape[-1])
        if blocks[0].shortlist is not None and blocks[0].shortlist.tokens.shape[-1] >= top_m:
            return torch.stack([block.shortlist.tokens for block in blocks])[..., :top_m]
        marginals = torch.stack([block.marginal_log_probs for block in blocks])
        return self.column_tokens(marginals.topk(top_m, dim=-1).indices)

    def score_rows(self, corrected: torch.Tensor, shortlist_tokens: torch.LongTensor | None,
                   log_mass: torch.Tensor | None) -> tuple[torch.LongTensor, torch.Tensor]:
        """Score AR-corrected hidden rows `[..., G, H]` (a group of G rows shares one child depth) on their group's
        shortlist `[..., C]` (with the marginal's `log_mass [...]`), or on the full vocabulary when None. Returns
        the top-K `child_tokens` and `child_log_probs`, `[..., G, K]`, sorted."""
        top_k = self.options.tree_top_k
        if shortlist_tokens is None:
            log_probs = self.draft_log_probs(corrected)  # [..., G, V']
            child = log_probs.topk(min(top_k, log_probs.shape[-1]), dim=-1)
            return self.column_tokens(child.indices), child.values
        logits = self.head.shortlist_logits(corrected, shortlist_tokens)  # [..., G, C]
        log_probs = torch.log_softmax(logits.float(), dim=-1) + log_mass[..., None, None]
        child = log_probs.topk(min(top_k, log_probs.shape[-1]), dim=-1)
        tokens = shortlist_tokens[..., None, :].expand(child.indices.shape[:-1] + shortlist_tokens.shape[-1:])
        return tokens.gather(-1, child.indices), child.values

    def prev2_tokens(self, blocks: list[BlockDraft]) -> torch.LongTensor | None:
        """`[R, D+2]`, entry d the token two back of a depth-d parent (2-token AR variant only; None otherwise):
        known for depth 0 (the committed token before b) and depth 1 (b); deeper parents use the top-1 marginal
        token of depth d-1 as a stand-in (rows are per (depth, token), not per path)."""
        if not self.two_prev_tokens:
            return None
        return torch.stack([
            torch.cat([torch.tensor([max(block.prev_token, 0), block.anchor_token], device=self.device),
                       self.column_tokens(block.marginal_log_probs.argmax(dim=-1))])
            for block in blocks
        ])

    def stage_two_inputs(self, blocks: list[BlockDraft]) -> StageTwoInputs:
        """The rows' `StageTwoInputs` (rows of one draft: the same depths)."""
        if blocks[0].shortlist is None:
            shortlist_tokens = log_mass = None
        else:
            shortlist_tokens = torch.stack([block.shortlist.tokens for block in blocks])
            log_mass = torch.stack([block.shortlist.log_mass for block in blocks])
        return StageTwoInputs(torch.stack([block.pre_norm_hidden for block in blocks]), shortlist_tokens, log_mass,
                              self.prev2_tokens(blocks))

    @torch.no_grad()
    def ar_tables(self, blocks: list[BlockDraft], max_depth: int) -> list[ARTable]:
        """`ar_table_tensors` as one `ARTable` per row (on the CPU)."""
        return [ARTable(*row) for row in zip(*(t.cpu() for t in self.ar_table_tensors(blocks, max_depth)))]

    def ar_table_tensors(self, blocks: list[BlockDraft], max_depth: int
                         ) -> tuple[torch.LongTensor, torch.Tensor, torch.LongTensor]:
        """Stage 2 for every row's top tree in one batch: for each parent depth d = 0..D'-1 (D' = `max_depth`) and
        each of the M parents there (the root at d = 0, `S_d` below), the top-K children from the AR-corrected
        distribution `q'_{d+1}(. | parent)`: about `M*D'` rows per batch row, independent of the budget. Returns
        `child_tokens`, `child_log_probs` `[R, D', M, K]` and the parents' tokens `[R, D', M]` (row 0: the anchor)."""
        device = self.device
        num_rows = len(blocks)
        top = self.top_tokens_of_rows(blocks)[:, : max_depth - 1]  # [R, D'-1, M]
        top_m = top.shape[-1]
        anchors = torch.tensor([block.anchor_token for block in blocks], device=device)
        parents = torch.cat([anchors[:, None, None].expand(num_rows, 1, top_m), top.to(device)], dim=1)  # [R, D', M]
        inputs = self.stage_two_inputs(blocks)
        hidden = inputs.hidden[:, 1 : max_depth + 1]  # [R, D', H]
        prev2 = inputs.prev2_tokens
        corrected = self.drafter.ar_corrected_hidden_states(
            hidden[:, :, None].expand(-1, -1, top_m, -1), self.embed(parents),
            None if prev2 is None else self.embed(prev2[:, :max_depth, None].expand(-1, -1, top_m)),
        )  # [R, D', M, H]
        if inputs.shortlist_tokens is None:
            child_tokens, child_log_probs = self.score_rows(corrected, None, None)
        else:  # [R, D', C] and [R, D']
            child_tokens, child_log_probs = self.score_rows(corrected, inputs.shortlist_tokens[:, :max_depth],
                                                            inputs.log_mass[:, :max_depth])
        return child_tokens, child_log_probs, parents

    @torch.no_grad()
    def ar_rows(self, inputs: StageTwoInputs, row_index: torch.LongTensor, parent_depths: torch.LongTensor,
                parent_tokens: torch.LongTensor) -> tuple[torch.LongTensor, torch.Tensor]:
        """Stage 2 for chosen parents of any rows (lazy evaluation): the top-K children (depth d+1) of a node carrying
        `parent_tokens[i]` at depth `d = parent_depths[i]` of the row `row_index[i]` (all `[G]`). Returns
        `child_tokens [G, K]` and `child_log_probs [G, K]`, sorted by decreasing log-prob."""
        device = self.device
        row_index, parent_depths, parent_tokens = (t.to(device) for t in (row_index, parent_depths, parent_tokens))
        prev2 = inputs.prev2_tokens
        corrected = self.drafter.ar_corrected_hidden_states(
            inputs.hidden[row_index, parent_depths + 1], self.embed(parent_tokens),
            None if prev2 is None else self.embed(prev2[row_index, parent_depths]),
        )  # [G, H]
        if inputs.shortlist_tokens is None:
            return self.score_rows(corrected, None, None)
        # each parent is its own group of one row, scored on the shortlist of its children's depth
        tokens, log_probs = self.score_rows(corrected[:, None], inputs.shortlist_tokens[row_index, parent_depths],
                                            inputs.log_mass[row_index, parent_depths])
        return tokens[:, 0], log_probs[:, 0]

    def build_tree(self, block: BlockDraft, budget: int, lookup: tuple[list[int], list[float]] | None = None,
                   max_depth: int | None = None) -> DraftTree:
        """One row's tree (see `build_trees`)."""
        return self.build_trees([block], budget, [lookup], max_depth).trees[0]

    @traced(TREE)
    def build_trees(self, blocks: list[BlockDraft], budget: int,
                    lookups: list[tuple[list[int], list[float]] | None], max_depth: int | None = None
                    ) -> TreeBatch:
        """The tree step: each row's tree of at most `budget` nodes (root included) for the configured mode, no deeper
        than `max_depth`. `lookups[r]` = (tokens, conditional log-prob of each) adds a lookup branch below row r's
        root (tree modes; `lookup.py`). Without lookup branches the trees are built for every row at once
        (`best_first_trees`); a lookup branch, or stage 2 evaluated lazily on a CPU, searches row by row (the lazy stage
        2's calls serve every row at once)."""
        depth = min(blocks[0].depth, budget - 1, blocks[0].depth if max_depth is None else max_depth)
        mode = self.options.tree_mode
        if depth <= 0 or mode == "chain":
            best = [block.marginal_log_probs[: max(depth, 0)].max(dim=-1) for block in blocks]
            return TreeBatch.pack([chain_tree(block.anchor_token, self.column_tokens(b.indices).cpu(), b.values.cpu())
                                   for block, b in zip(blocks, best)], chains=True)

        roots = torch.tensor([block.anchor_token for block in blocks])
        batched = not any(lookup is not None and lookup[0] for lookup in lookups)  # (a lookup branch: per row)

        def search(block, lookup, children_of) -> DraftTree:
            return search_tree(block.anchor_token, children_of, budget, depth, lookup)

        if mode == "marginal_tree":
            # row d holds the children at depth d+1, whatever the parent
            marginal = torch.stack([b.marginal_log_probs for b in blocks])[:, :depth]
            marginal = marginal.topk(min(self.options.tree_top_k, marginal.shape[-1]), dim=-1)
            marginal_tokens = self.column_tokens(marginal.indices)
            if batched:  # every row at once: children hang off every node of a depth alike
                return best_first_trees(roots, marginal_tokens[:, :, None], marginal.values[:, :, None], None, budget,
                                        depth)
            return TreeBatch.pack([search(block, lookup, table_children(tokens, values, lambda d, token: d))
                                   for block, lookup, tokens, values in zip(blocks, lookups, marginal_tokens,
                                                                            marginal.values)])
        # costs in AR rows: one call and every (depth, top-M token) row of each batch row, or a few calls and
        # about LAZY_ROWS_PER_NODE rows per tree node (a round recomputes what the marginals' guess got wrong)
        batched_cost = self.call_cost_in_rows + len(blocks) * (1 + (depth - 1) * self.options.tree_top_m)
        lazy_cost = LAZY_CALLS * self.call_cost_in_rows + len(blocks) * LAZY_ROWS_PER_NODE * (budget - 1)
        if self.ar_evaluation == "batched" or (self.ar_evaluation == "auto" and lazy_cost >= batched_cost):
            child_tokens, child_log_probs, parents = self.ar_table_tensors(blocks, depth)
            if batched:
                return best_first_trees(roots, child_tokens, child_log_probs, parents, budget, depth)
            tables = [ARTable(*row) for row in zip(child_tokens.cpu(), child_log_probs.cpu(), parents.cpu())]
            return TreeBatch.pack([search(block, lookup, table.children())
                                   for block, lookup, table in zip(blocks, lookups, tables)])
        return self.lazy_trees(blocks, budget, depth, lookups)

    def lazy_trees(self, blocks: list[BlockDraft], budget: int, depth: int,
                   lookups: list[tuple[list[int], list[float]] | None]) -> TreeBatch:
        """`build_trees` with stage 2 evaluated only for the nodes the rows' best-first searches expand, in rounds of
        one call for every row: each round searches every row with the AR rows known so far (a node without its row
        takes its depth's marginal top-K as a stand-in and is noted), then computes every noted row. A search
        follows the exact one up to its first stand-in, so each round extends the exact part: a round without
        stand-ins gives the exact trees, after at most `budget` calls (about 3 in practice; the first computes the
        marginals' guess)."""
        inputs = self.stage_two_inputs(blocks)
        top = self.top_tokens_of_rows(blocks).cpu()  # [R, D, M]
        marginal = torch.stack([block.marginal_log_probs[:depth] for block in blocks])  # [R, D, V']
        marginal = marginal.topk(min(self.options.tree_top_k, marginal.shape[-1]), dim=-1)
        stand_in = zip(self.column_tokens(marginal.indices).tolist(), marginal.values.tolist())
        rows = [LazyARChildren(row_top, list(zip(*row_stand_in))) for row_top, row_stand_in in zip(top, stand_in)]
        for _ in range(budget + 1):  # (each search expands at most `budget` nodes)
            trees = [search_tree(block.anchor_token, row.children_of, budget, depth, lookup)
                     for block, row, lookup in zip(blocks, rows, lookups)]
            missing = [(index, *key) for index, row in enumerate(rows) for key in row.take_missing()]
            if not missing:
                return TreeBatch.pack(trees)
            row_index, parent_depths, parent_tokens = torch.tensor(missing).unbind(1)
            child_tokens, child_log_probs = self.ar_rows(inputs, row_index, parent_depths, parent_tokens)
            for (index, *key), tokens, log_probs in zip(missing, child_tokens.tolist(), child_log_probs.tolist()):
                rows[index].known[tuple(key)] = (tokens, log_probs)
        raise AssertionError("the lazy stage 2 did not converge")  # (unreachable, see above)


def search_tree(root_token: int, children_of, budget: int, depth: int,
                lookup: tuple[list[int], list[float]] | None) -> DraftTree:
    """One row's best-first tree, with its lookup branch below the root when it has one."""
    if lookup is not None and lookup[0]:
        children_of = with_lookup_branch(children_of, *lookup)
    return best_first_tree(root_token, children_of, budget, depth)


class LazyARChildren:
    """One row's stage-2 rows for the rounds of `TreeDrafter.lazy_trees`: `children_of(depth, token)` gives a
    node's AR children once `known`; until then its depth's marginal top-K stands in, and the node is noted as
    missing. Only the root and a node carrying a top-M token of its depth (`S_d`) have children.

    top: `[D, M]` `S_d` for depths 1..D (on the CPU); stand_in: per depth d = 0..D-1, the marginal top-K (tokens,
    log-probs) of depth d + 1."""

    def __init__(self, top: torch.LongTensor, stand_in: list[ChildList]):
        self.top = top
        self.stand_in = stand_in
        self.expandable: dict[int, set[int]] = {}  # S_d, made when a search first asks about depth d
        self.known: dict[tuple[int, int], ChildList] = {}
        self.missing: dict[tuple[int, int], None] = {}  # (an ordered set)

    def has_children(self, depth: int, token: int) -> bool:
        if depth == 0:
            return True
        if depth >= len(self.top):  # (the deepest scored depth has no marginal below it)
            return False
        if depth not in self.expandable:
            self.expandable[depth] = set(self.top[depth - 1].tolist())
        return token in self.expandable[depth]

    def children_of(self, depth: int, token: int) -> ChildList | None:
        if not self.has_children(depth, token):
            return None
        children = self.known.get((depth, token))
        if children is None:
            self.missing[(depth, token)] = None
            return self.stand_in[depth]
        return children

    def take_missing(self) -> list[tuple[int, int]]:
        """The nodes noted since the last call."""
        missing, self.missing = list(self.missing), {}
        return missing
