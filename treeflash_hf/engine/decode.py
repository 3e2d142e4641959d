"""The TreeFlash decode loop: one `Decoder.advance` per step, shared by `generate()` and continuous batching.

Pipeline per step (one target forward each): draft -> build tree -> verify -> accept -> commit caches. A step may
skip the draft and verify the lookup branch or the root alone (`lookup.StepScheduler`); the drafter then receives
the skipped positions' context with its next draft.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .accept import Acceptance, RowProcessor, greedy_accept, sampled_accept, walk_tree
from .answer_store import AnswerStore
from .cache import append_rows, check_cache_supported, compact_cache, growing_cache, repack, select_rows, valid_or_all
from .draft import DraftContext, TreeDrafter
from .learned import learned_state
from .lookup import (MAX_NGRAM, MIN_PATH_PROB, NO_SOURCE, LookupSource, expected_accepted, ngram_continuation,
                     useful_length)
from .options import OPTION_NAMES, TreeOptions
from .sync import DecisionSync
from .trace import ACCEPT, COMMIT, PREFILL, traced
from .tree import TreeBatch, chain_tree
from .validation import (
    TreeFlashInputError,
    check_attention_backend,
    check_inputs,
    check_pair,
)
from .verify import check_forward_shapes, run_target, verify_trees

logger = logging.getLogger(__name__)


@dataclass
class TreeFlashStats:
    """Per verification step: `accepted_lengths` drafted tokens accepted (the bonus token not counted),
    `tree_sizes` nodes verified (root included), `expected_accepted_lengths` the drafter's own estimate,
    `step_kinds` what the step verified: `"draft"` (the drafter's tree), `"lookup"` (the lookup branch alone) or
    `"plain"` (the root alone); the last two skip the drafter."""

    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    expected_accepted_lengths: list[float] = field(default_factory=list)
    step_kinds: list[str] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Block efficiency: tokens emitted per target forward (accepted + bonus), averaged over steps."""
        if not self.accepted_lengths:
            return float("nan")
        return 1.0 + sum(self.accepted_lengths) / len(self.accepted_lengths)

    @classmethod
    def pooled(cls, rows: list["TreeFlashStats"]) -> "TreeFlashStats":
        """Every row's steps, row after row (its `tau` is the batch's: all tokens over all row-steps)."""
        pooled = cls()
        for row in rows:
            pooled.accepted_lengths += row.accepted_lengths
            pooled.tree_sizes += row.tree_sizes
            pooled.expected_accepted_lengths += row.expected_accepted_lengths
            pooled.step_kinds += row.step_kinds
        return pooled


@dataclass
class TreeFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus per-step statistics: `accepted_lengths`, `tree_sizes`,
    `expected_accepted_lengths`, `step_kinds` (one entry per verification step of each row, rows one after the
    other) and `tau` (over all rows); `per_row` holds each row's own `TreeFlashStats` and `tau_per_row` its τ."""

    accepted_lengths: list[int] | None = None
    tree_sizes: list[int] | None = None
    expected_accepted_lengths: list[float] | None = None
    step_kinds: list[str] | None = None
    tau: float | None = None
    per_row: list[TreeFlashStats] | None = None
    tau_per_row: list[float] | None = None


class Rows:
    """The working batch: the state of the rows still decoding, in batch order. Rows that finish leave it
    (`leave`), and every batched tensor (caches, masks, pending context) is narrowed with them. What the host
    decides from (token ids, lengths) is kept on the host, so that a step reads the device once.

    ids: row identities (original row indices; under continuous batching, request numbers); token_ids: per row
    the padded prompt, then its new tokens (host lists; `sequence(row)` is one as a tensor); pads: left padding
    per row; limits: per row the longest its sequence may grow (padding included); root_tokens: per row the
    committed token the next step verifies first (not yet run by the target); lengths: per row the root's position
    (its own count of real tokens before the root; `root_positions` as a tensor); drafted_lengths: per row
    the real tokens the drafter's cache holds (valid slots: `lengths` at the last draft); key_valid: `[R, L]` the
    target-cache slots each row may attend (None: all); pending: the context features the drafter has not seen yet
    (`DraftContext`), joined with each step's kept positions until the next draft."""

    def __init__(self, input_ids: torch.LongTensor, key_valid: torch.BoolTensor | None,
                 root_positions: torch.LongTensor, pending: DraftContext, limits: list[int],
                 ids: list[int] | None = None):
        self.ids = list(range(input_ids.shape[0])) if ids is None else list(ids)
        self.device = input_ids.device
        self.token_ids: list[list[int]] = input_ids.tolist()
        self.pads = [0] * len(self.ids) if key_valid is None else (~key_valid).sum(dim=1).tolist()
        self.limits = list(limits)
        self.root_tokens: list[int] = []
        self.lengths: list[int] = root_positions.tolist()
        self.drafted_lengths = [0] * len(self.ids)
        self.key_valid = key_valid
        self.pending: DraftContext | None = pending

    # the per-row host lists, narrowed and extended together as rows leave and join
    HOST_FIELDS = ("ids", "token_ids", "pads", "limits", "root_tokens", "lengths", "drafted_lengths")

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def root_positions(self) -> torch.LongTensor:
        """`[R]` each row's root position (`lengths` as a tensor, for the forwards' position ids)."""
        return torch.tensor(self.lengths, dtype=torch.long)

    def sequence(self, row: int) -> torch.LongTensor:
        """Row `row`'s tokens so far as `[1, S]` (for logits processors and stopping criteria that read them)."""
        return torch.tensor([self.token_ids[row]], dtype=torch.long, device=self.device)

    def leave(self, finished: list[bool], cache, generator: TreeDrafter) -> dict[int, list[int]]:
        """Drop the finished rows from the batch and from both caches; returns their token ids by original id."""
        done = {self.ids[row]: self.token_ids[row] for row, flag in enumerate(finished) if flag}
        keep = [row for row, flag in enumerate(finished) if not flag]
        if keep and done:
            index = torch.tensor(keep)
            select_rows(cache, index)
            generator.select_rows(index)
            for name in self.HOST_FIELDS:
                values = getattr(self, name)
                setattr(self, name, [values[i] for i in keep])
            self.key_valid = None if self.key_valid is None else self.key_valid[index]
            pending = self.pending
            self.pending = DraftContext(pending.features[index.to(pending.features.device)], pending.positions[index],
                                        None if pending.valid is None else pending.valid[index])
        elif not keep:
            self.ids = []
        return done

    def join(self, newcomers: list[tuple["Rows", DynamicCache]], cache, generator: TreeDrafter) -> None:
        """Continuous batching: append freshly prefilled rows (each `Rows` with its own target cache, roots set) to
        this batch, between two steps. Both caches get the newcomers' rows (the drafter's as slots none of them may
        attend: their prompts reach the drafter as pending context with the next draft); the shorter caches are
        padded with invalid slots. Exact: a row attends only its own valid slots."""
        if not newcomers:
            return
        groups = [(self, cache)] + newcomers
        self.key_valid = append_rows(cache, self.key_valid, [(new_cache, new.key_valid) for new, new_cache in newcomers])
        generator.add_rows(sum(len(new) for new, _ in newcomers))
        self.pending = stack_contexts([rows.pending for rows, _ in groups])
        for new, _ in newcomers:
            for name in self.HOST_FIELDS:
                getattr(self, name).extend(getattr(new, name))

    @traced(COMMIT)
    def commit(self, accepted: list[Acceptance], hidden_states: tuple, cache, past_len: int,
               generator: TreeDrafter) -> None:
        """Commit: each row keeps its root and accepted nodes in the target cache (one row-wise gather; a row that
        keeps fewer marks its extra slots invalid) and queues their context features for the drafter. Every
        decision is taken on the host's copy of the step's outcome."""
        kept_counts = [len(result.visited) for result in accepted]
        num_kept = max(kept_counts)
        all_kept = min(kept_counts) == num_kept
        # a row that keeps fewer repeats its last node (that slot is marked invalid)
        kept_nodes = [result.visited + result.visited[-1:] * (num_kept - count)
                      for result, count in zip(accepted, kept_counts)]
        contiguous = all(nodes == list(range(num_kept)) for nodes in kept_nodes)
        kept_nodes = torch.tensor(kept_nodes)  # [R, K]
        compact_cache(cache, past_len, kept_nodes, contiguous)
        kept_valid = None if all_kept else torch.arange(num_kept)[None] < torch.tensor(kept_counts)[:, None]
        if self.key_valid is not None or not all_kept:
            self.key_valid = torch.cat([valid_or_all(self.key_valid, len(self), past_len),
                                        valid_or_all(kept_valid, len(self), num_kept)], dim=1)
        # the kept nodes are the path, one per depth: their positions follow the root's
        kept = DraftContext(generator.context_features(hidden_states, kept_nodes),
                            self.root_positions[:, None] + torch.arange(num_kept), kept_valid)
        self.pending = kept if self.pending is None else join_contexts(self.pending, kept)
        self.lengths = [length + count for length, count in zip(self.lengths, kept_counts)]
        self.root_tokens = [result.tokens[-1] for result in accepted]
        self.key_valid = repack(cache, self.key_valid, valid_counts=self.lengths)
        generator.repack(valid_counts=self.drafted_lengths)


@dataclass
class StepPlan:
    """What one step verifies. kind: `"draft"`, `"lookup"` or `"plain"` (see `lookup.StepScheduler`); trees: every
    row's tree (`TreeBatch`); branches / sources / branch_expected: each row's lookup branch (tokens, log-probs),
    where it came from (`LookupSource`) and its expected accepted tokens (None: no branch; on a draft step, of the
    part the tree was offered)."""

    kind: str
    trees: TreeBatch | None
    branches: list[tuple[list[int], list[float]]]
    sources: list[LookupSource]
    branch_expected: list[float | None]
    drafted_depth: int = 0  # on a draft step, the depths the drafter scored
    deepened: bool = False  # on a draft step, whether its trees asked for the depths left unscored


def lookup_branches(rows: Rows, lookup_rates, lengths: list[int], store: AnswerStore | None = None):
    """Per row, the lookup branch `(tokens, log_probs)` of at most `lengths[r]` tokens (empty when nothing matches)
    and its source (`LookupSource`), cut where its path probability falls below `MIN_PATH_PROB`: the continuation
    from the row's own text (`ngram_continuation`) or, with an answer `store`, from the target's earlier answers,
    whichever the learned acceptance rates expect to yield more."""
    branches, sources = [], []
    for token_ids, pad, length in zip(rows.token_ids, rows.pads, lengths):
        best, best_expected = ([], [], NO_SOURCE), -1.0
        candidates = []
        if length > 0:
            sequence = token_ids[pad:]
            tokens, ngram = ngram_continuation(sequence, MAX_NGRAM, length)
            candidates.append((tokens, ("sequence", ngram)))
            if store is not None:
                match = store.continuation(sequence, length)
                candidates.append((match.tokens, ("store", match.order)))
        for tokens, source in candidates:
            if not tokens:
                continue
            log_probs = lookup_rates.log_probs(source, len(tokens))
            keep = useful_length(log_probs, MIN_PATH_PROB)
            expected = expected_accepted(log_probs[:keep])
            if expected > best_expected:
                best, best_expected = (tokens[:keep], log_probs[:keep], source), expected
        branches.append(best[:2])
        sources.append(best[2])
    return branches, sources


def deepest_node(trees: TreeBatch) -> int:
    """The depth of the deepest node of any row's tree (one read for every row)."""
    return int(trees.depths.max())


def plan_step(rows: Rows, options: TreeOptions, learned, generator: TreeDrafter,
              sync: DecisionSync) -> StepPlan:
    """Draft and tree for every row: the lookup branches, the step kind, and (on a draft step) one batched drafter
    forward and each row's tree; under `tree_budget="auto"`, the width every row verifies."""
    auto_budget, schedule = learned.auto_budget, learned.schedule
    num_rows = len(rows)
    remaining = [limit - len(token_ids) for limit, token_ids in zip(rows.limits, rows.token_ids)]
    # the budget counts the root; under "auto" a branch verified alone may fill the largest measured forward
    lookup_cap = options.tree_budget if auto_budget is None else max(1, auto_budget.max_size // num_rows)
    lookup_lengths = [min(options.tree_lookup, left - 1, lookup_cap - 1) for left in remaining]
    branches, sources = lookup_branches(rows, learned.lookup_rates, lookup_lengths, generator.answer_store)
    branch_expected = [expected_accepted(log_probs) if tokens else None for tokens, log_probs in branches]
    # a drafted tree holds fewer of a long branch's tokens than a step verifying the branch alone (under "auto",
    # about the settled width's): judged by what it holds, the drafter's gain is not read as a loss
    tree_holds = (options.tree_budget if auto_budget is None else auto_budget.last_best) - 1
    in_tree = [expected_accepted(log_probs[:tree_holds]) if tokens else None for tokens, log_probs in branches]
    # budget 1 is plain decoding asked for (or all "auto" can verify per row): nothing for the scheduler to choose
    plain_bound = {} if auto_budget is None else {"plain": auto_budget.verify_cost(num_rows)}
    kind = "plain" if lookup_cap == 1 else schedule.choose(branch_expected, share=sync.share_step_kind,
                                                            lower_bounds=plain_bound, in_tree=in_tree)
    budget = options.tree_budget
    # a chain reaches every depth it drafts: only trees score their depths lazily
    lazy_depths = options.tree_mode != "chain"
    if kind == "draft" and auto_budget is not None:
        # a drafted step the scheduler tries (not its best kind) is measured at the width it would use: no wider
        # tree to explore the width on top of it
        budget = auto_budget.plan(num_rows, share=sync.share_int, may_explore=not sync.share_int(schedule.explored),
                                  depth_cap=learned.scored_depth.depth(generator.block_size - 1) if lazy_depths
                                  else None)
    plan = StepPlan(kind, None, branches, sources, branch_expected)
    if kind == "plain":  # the roots alone; the drafter catches up with its next draft
        plan.trees = TreeBatch.roots(torch.tensor(rows.root_tokens))
    elif kind == "lookup":  # the lookup branches alone; likewise
        trees = [chain_tree(token, torch.tensor(tokens, dtype=torch.long), torch.tensor(log_probs))
                 for token, (tokens, log_probs) in zip(rows.root_tokens, branches)]
        if auto_budget is not None:
            width = auto_budget.choose_lookup(trees, share=sync.share_int)
            trees = [tree.prefix(min(width, tree.size)) for tree in trees]
        plan.trees = TreeBatch.pack(trees, chains=True)
    else:
        prev_tokens = [token_ids[-2] for token_ids in rows.token_ids]
        capped = [(tokens[: budget - 1], log_probs[: budget - 1]) if tokens else None
                  for tokens, log_probs in branches]
        plan.branch_expected = [None if branch is None else expected_accepted(branch[1]) for branch in capped]
        depth_limit = min(max(remaining), budget) - 1
        scored = learned.scored_depth.depth(depth_limit, max((len(branch[0]) for branch in capped if branch),
                                                             default=0)) if lazy_depths else None
        blocks = generator.draft(rows.root_tokens, rows.root_positions, rows.pending, max_depth=depth_limit,
                                 prev_tokens=prev_tokens, scored_depth=scored)
        rows.pending = None
        rows.drafted_lengths = list(rows.lengths)  # the drafter's cache now holds every committed token
        plan.trees = generator.build_trees(blocks, budget, capped)
        deepest = deepest_node(plan.trees)
        if generator.search_stopped_at_scored_depth(blocks, deepest):
            generator.score_deeper(blocks)
            plan.deepened = True
            plan.trees = generator.build_trees(blocks, budget, capped)
            deepest = deepest_node(plan.trees)
        learned.scored_depth.observe(deepest)
        plan.drafted_depth = blocks[0].depth
        if auto_budget is not None:
            plan.trees = plan.trees.prefix(auto_budget.choose(plan.trees.size_list()))
    return plan


@traced(ACCEPT)
def accept_all(trees: TreeBatch, logits: torch.Tensor, rows: Rows, process: RowProcessor, do_sample: bool,
               sync: DecisionSync) -> list[Acceptance]:
    """Accept for every row: batched greedy or sampled acceptance when the processors read the scores alone, else
    each row's walk (processors that read the sequence: repetition penalty, n-gram bans, bad words; the slow path).
    Sampled choices are rank 0's under tensor parallelism."""
    if not do_sample and not len(process):
        return greedy_accept(trees, logits)
    if do_sample and process.row_wise and not sync.active:  # (under tensor parallelism rank 0 draws: below)
        return sampled_accept(trees, logits, process.logits_processor)
    accepted = [
        walk_tree(tree, logits[row, : tree.size], rows.sequence(row),
                  functools.partial(process, row_id) if len(process) else None, do_sample)
        for row, (tree, row_id) in enumerate(zip(trees.trees, rows.ids))
    ]
    if do_sample and sync.active:
        paths = sync.share_token_lists([a.path for a in accepted])
        tokens = sync.share_token_lists([a.tokens for a in accepted])
        accepted = [a if (a.path, a.tokens) == (path, token_list) else
                    Acceptance(path, token_list, [0] + path, [logits[row, n : n + 1] for n in [0] + path])
                    for row, (a, path, token_list) in enumerate(zip(accepted, paths, tokens))]
    return accepted


def learn_from_step(learned, plan: StepPlan, accepted: list[Acceptance], seconds: float,
                    verify_seconds: float) -> None:
    """Feed what the step showed to the state carried across calls: lookup acceptance rates, the scheduler's times
    and yields, auto's per-place acceptance rates and costs (`seconds`: the whole step; `verify_seconds`: of it,
    the target's forward and the acceptance)."""
    for (tokens, _), source, result in zip(plan.branches, plan.sources, accepted):
        if tokens:
            learned.lookup_rates.observe(source, tokens, result.tokens)
    accepted_lengths = [len(result.path) for result in accepted]
    learned.schedule.observe(plan.kind, seconds, accepted_lengths, plan.branch_expected)
    if learned.auto_budget is not None and plan.kind == "draft":
        learned.auto_budget.observe(plan.trees.size_list(), [result.path for result in accepted], seconds,
                                    verify_seconds, plan.drafted_depth, plan.deepened, plan.trees.path_log_probs.exp())


@dataclass
class StepResult:
    """One verification step of the working batch: its plan, the packed trees, each row's acceptance, the
    verified logits `[R, N, V]`, the target's hidden states and the cache length before the step."""

    plan: StepPlan
    accepted: list[Acceptance]
    logits: torch.Tensor
    hidden_states: tuple
    past_len: int


@dataclass
class Decoder:
    """What every step of one decoding run shares: the target, the drafting side, the options, the state learned
    across calls, the logits processors and the sampling switch. `treeflash_decode` (a static batch) and continuous
    batching (`continuous_batching.TreeFlashBatchProcessor`, rows joining and leaving between steps) run the same
    `prefill` and `step`."""

    target: torch.nn.Module
    generator: TreeDrafter
    options: TreeOptions
    learned: object
    process: RowProcessor
    do_sample: bool
    sync: DecisionSync
    device: torch.device  # where the target's inputs and outputs live

    @property
    def layer_ids(self) -> list[int]:
        return self.generator.target_layer_ids

    @traced(PREFILL)
    def prefill(self, input_ids: torch.LongTensor, attention_mask: torch.LongTensor | None,
                position_ids: torch.LongTensor, cache, limits: list[int],
                ids: list[int] | None = None) -> tuple[Rows, torch.Tensor]:
        """Run the target on the left-padded prompts `input_ids [B, S]` into the empty `cache`. Returns the working
        rows (their roots not yet set: the caller chooses the first tokens) and the last position's raw logits
        `[B, V]` (float32, on `device`)."""
        key_valid = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool().cpu()
        out = run_target(self.target, input_ids, position_ids, attention_mask, cache, self.layer_ids, logits_to_keep=1)
        first_prompt = input_ids[0] if key_valid is None else input_ids[0, key_valid[0].to(input_ids.device)]
        check_forward_shapes(self.target, first_prompt, self.layer_ids, self.device)  # once per target
        context = DraftContext(self.generator.context_features(out.hidden_states, slice(None)), position_ids.cpu(),
                               key_valid)
        rows = Rows(input_ids, key_valid, position_ids[:, -1].cpu() + 1, context, limits, ids)
        return rows, out.logits[:, -1].float().to(self.device)

    def step(self, rows: Rows, cache) -> StepResult:
        """Draft, tree, verify and accept for every row of the working batch: draft -> build trees -> verify -> accept. The caller emits
        the accepted tokens and then commits the caches (`rows.commit`)."""
        started = time.perf_counter()
        plan = plan_step(rows, self.options, self.learned, self.generator, self.sync)
        trees = plan.trees
        past_len = cache.get_seq_length()
        verify_started = time.perf_counter()
        logits, hidden_states = verify_trees(self.target, trees, cache, rows.root_positions, rows.key_valid,
                                             self.layer_ids, self.device)
        accepted = accept_all(trees, logits, rows, self.process, self.do_sample, self.sync)  # (waits for logits)
        ended = time.perf_counter()
        learn_from_step(self.learned, plan, accepted, ended - started, ended - verify_started)
        return StepResult(plan, accepted, logits, hidden_states, past_len)

    def commit(self, rows: Rows, result: StepResult, cache) -> None:
        """Commit: each row keeps its accepted path in both caches."""
        rows.commit(result.accepted, result.hidden_states, cache, result.past_len, self.generator)

    def advance(self, rows: Rows, cache, emit: Callable[[int, int, Callable], bool]) -> tuple[StepResult, list[bool]]:
        """One decode step of the working batch, the loop body of every caller: `step`, then each row's accepted
        tokens go to `emit(row, token, scores_of) -> stop` in order until one stops that row (nothing is emitted
        past a stop), then `commit` for the rows that go on. `scores_of()` gives the token's processed scores and
        raw logits, `[1, V]` each (sliced only when asked). Returns the step and which rows finished (the caller lets
        them leave)."""
        step = self.step(rows, cache)
        finished = [False] * len(rows)
        for row, result in enumerate(step.accepted):
            for index, token in enumerate(result.tokens):
                if emit(row, token, functools.partial(token_scores, step, row, index)):
                    finished[row] = True
                    break
        if not all(finished):
            self.commit(rows, step, cache)
        return step, finished


def token_scores(step: StepResult, row: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The processed scores and raw logits, `[1, V]` each, that the `index`-th token of working row `row` in `step`
    was chosen from."""
    result = step.accepted[row]
    node = result.visited[index]
    return result.token_scores(index), step.logits[row, node : node + 1]


@dataclass(frozen=True)
class TokenStops:
    """`generate()`'s stopping criteria when they are only a length limit and end tokens (`MaxLengthCriteria`,
    `EosTokenCriteria`, what `generate()` builds by itself): checked on the token ids the host already holds, so
    emitting a token reads nothing from the device. `of` gives None when any other criterion is present: those are
    called per emitted token (the slow path: a stop string or a user's criterion reads the sequence)."""

    max_length: int | None
    end_tokens: frozenset[int]

    @classmethod
    def of(cls, criteria) -> "TokenStops | None":
        max_length, end_tokens = None, set()
        for criterion in criteria or []:
            if type(criterion) is MaxLengthCriteria:
                max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
            elif type(criterion) is EosTokenCriteria:
                end_tokens.update(criterion.eos_token_id.flatten().tolist())
            else:
                return None
        return cls(max_length, frozenset(end_tokens))

    def stops(self, token: int, length: int) -> bool:
        """Whether a row must stop after emitting `token`, now `length` tokens long."""
        return token in self.end_tokens or (self.max_length is not None and length >= self.max_length)


class StepRecorder:
    """Per original row, the statistics of every verification step (`TreeFlashStats`). What the host has (accepted
    lengths, step kinds) is appended at once; what lives on the device (tree sizes, the drafter's estimate) is kept
    as tensors and read once, by `finish`."""

    def __init__(self, batch_size: int):
        self.stats = [TreeFlashStats() for _ in range(batch_size)]
        self.on_device: list[tuple[list[int], torch.Tensor]] = []  # (row ids, [2, R]: sizes, estimates)

    def record(self, rows: Rows, step: StepResult) -> None:
        """One verification step of every working row."""
        trees = step.plan.trees
        estimate = trees.path_log_probs[:, 1:].exp().sum(dim=1)  # the drafter's own estimate (padding: exp(-inf))
        self.on_device.append((list(rows.ids), torch.stack([trees.sizes().to(estimate.dtype), estimate])))
        for row_id, result in zip(rows.ids, step.accepted):
            row_stats = self.stats[row_id]
            row_stats.accepted_lengths.append(len(result.path))
            row_stats.step_kinds.append(step.plan.kind)

    def finish(self) -> list[TreeFlashStats]:
        if self.on_device:
            values = torch.cat([t.cpu() for _, t in self.on_device], dim=1).tolist()  # the one read
            sizes, estimates = iter(values[0]), iter(values[1])
            for ids, _ in self.on_device:
                for row_id in ids:
                    self.stats[row_id].tree_sizes.append(int(next(sizes)))
                    self.stats[row_id].expected_accepted_lengths.append(next(estimates))
            self.on_device = []
        return self.stats


@torch.no_grad()
def treeflash_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    drafter=None,
    options: TreeOptions | None = None,
    streamer=None,
    candidate_generator: TreeDrafter | None = None,
    **model_kwargs,
) -> torch.LongTensor | TreeFlashGenerateOutput:
    """TreeFlash speculative decoding of the left-padded batch `input_ids [B, S]` with target `model`.

    Has the signature of a transformers decoding method, so `generate()` prepares everything (config, logits
    processors, stopping criteria, cache) and hands over. Each row drafts its own block (one batched drafter
    forward), builds its own tree, and one target forward verifies every row's tree; each row keeps exactly its
    accepted path in both caches. Stopping criteria are checked after every emitted token of every row, so
    nothing is emitted past a stop; finished rows leave the working batch and are padded with `pad_token_id`.
    `candidate_generator` replaces the default drafting side (a `TreeDrafter` subclass with other
    drafting or tree rules). Of `model_kwargs`, the target's `attention_mask` `[B, S]`, `position_ids` `[B, S]`
    and `cache` are used.
    """
    attention_mask = model_kwargs.get("attention_mask")
    position_ids = model_kwargs.get("position_ids")
    cache = model_kwargs.get("cache")
    target = model
    options = options or TreeOptions.resolve(drafter, {})
    check_inputs(target, input_ids, attention_mask, generation_config, streamer)
    check_pair(target, drafter)
    check_attention_backend(target)
    cache = growing_cache(cache if cache is not None else DynamicCache(config=target.config))
    check_cache_supported(cache)
    if cache.get_seq_length() > 0:
        raise TreeFlashInputError("TreeFlash decoding starts from an empty cache: do not pass a pre-filled cache.")
    do_sample = bool(generation_config.do_sample)
    return_dict = bool(generation_config.return_dict_in_generate)
    keep_scores = return_dict and bool(generation_config.output_scores)
    keep_logits = return_dict and bool(generation_config.output_logits)
    sync = DecisionSync(target)
    generator = candidate_generator or TreeDrafter(drafter, target, options)
    batch_size = input_ids.shape[0]
    decoder = Decoder(
        target=target, generator=generator, options=options,
        learned=learned_state(drafter, target, options, generation_config, sync),  # carried over from earlier calls
        process=RowProcessor(logits_processor, batch_size), do_sample=do_sample, sync=sync,
        device=target.get_input_embeddings().weight.device,
    )

    # Prefill: the target runs on the (left-padded) prompts; its next tokens are the first roots.
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(batch_size, -1)
    rows, raw = decoder.prefill(input_ids, attention_mask, position_ids, cache,
                                [generation_config.max_length] * batch_size)
    processed = logits_processor(input_ids, raw.clone()) if len(logits_processor) else raw
    if do_sample:
        first_tokens = sync.share_ints(torch.multinomial(torch.softmax(processed, dim=-1), 1)[:, 0].tolist())
    else:
        first_tokens = processed.argmax(dim=-1).tolist()

    recorder = StepRecorder(batch_size)
    scores: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]
    raw_logits: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]
    results: dict[int, list[int]] = {}
    token_stops = TokenStops.of(stopping_criteria)

    def emit(row: int, token: int, scores_of: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Commit one token to working row `row`; True when that row must stop. `scores_of()`: the processed scores
        and raw logits `[1, V]` it was chosen from."""
        token_ids = rows.token_ids[row]
        token_ids.append(token)
        if keep_scores or keep_logits:
            token_scores, token_raw = scores_of()
            if keep_scores:
                scores[rows.ids[row]].append(token_scores)
            if keep_logits:
                raw_logits[rows.ids[row]].append(token_raw)
        if streamer is not None:
            streamer.put(torch.tensor([token]))
        if token_stops is not None:
            return token_stops.stops(token, len(token_ids))
        return bool(stopping_criteria(rows.sequence(row), scores_of()[0]).any())

    finished = [emit(row, token, lambda row=row: (processed[row : row + 1], raw[row : row + 1]))
                for row, token in enumerate(first_tokens)]
    rows.root_tokens = first_tokens
    while True:
        results.update(rows.leave(finished, cache, generator))
        if not len(rows):
            break
        step, finished = decoder.advance(rows, cache, emit)
        recorder.record(rows, step)

    if streamer is not None:
        streamer.end()
    width = max(len(token_ids) for token_ids in results.values())
    pad = generation_config.pad_token_id or 0  # (a batch has one; a single row is never padded)
    sequences = torch.tensor([results[row] + [pad] * (width - len(results[row])) for row in range(batch_size)],
                             dtype=torch.long, device=input_ids.device)
    stats = recorder.finish()
    if not return_dict:
        return sequences
    pooled = TreeFlashStats.pooled(stats)
    return TreeFlashGenerateOutput(
        sequences=sequences,
        scores=positionwise(scores, width - input_ids.shape[1]) if keep_scores else None,
        logits=positionwise(raw_logits, width - input_ids.shape[1]) if keep_logits else None,
        cache=cache,
        accepted_lengths=pooled.accepted_lengths,
        tree_sizes=pooled.tree_sizes,
        expected_accepted_lengths=pooled.expected_accepted_lengths,
        step_kinds=pooled.step_kinds,
        tau=pooled.tau,
        per_row=stats,
        tau_per_row=[row.tau for row in stats],
    )


def context_valid(context: DraftContext) -> torch.BoolTensor:
    """`[R, L]`: which of the context's entries are real (its `valid`, or all)."""
    return valid_or_all(context.valid, *context.positions.shape)


def join_contexts(first: DraftContext, second: DraftContext) -> DraftContext:
    """Context features of `first`'s positions followed by `second`'s, per row (validity kept)."""
    both_valid = first.valid is None and second.valid is None
    return DraftContext(torch.cat([first.features, second.features], dim=1),
                        torch.cat([first.positions, second.positions], dim=1),
                        None if both_valid else torch.cat([context_valid(first), context_valid(second)], dim=1))


def stack_contexts(contexts: list[DraftContext]) -> DraftContext:
    """The rows of every context, one after the other; shorter ones padded with invalid entries. (Between steps
    every row has pending context: at least the slots its last step kept.)"""
    width = max(context.positions.shape[1] for context in contexts)
    features, positions, valid = [], [], []
    for context in contexts:
        pad = width - context.positions.shape[1]
        features.append(torch.nn.functional.pad(context.features, (0, 0, 0, pad)))
        positions.append(torch.nn.functional.pad(context.positions, (0, pad)))
        valid.append(torch.nn.functional.pad(context_valid(context), (0, pad), value=False))
    all_valid = torch.cat(valid)
    return DraftContext(torch.cat(features), torch.cat(positions), None if bool(all_valid.all()) else all_valid)


def positionwise(per_row: list[list[torch.Tensor]], length: int) -> tuple[torch.Tensor, ...]:
    """Per-row lists of `[1, V]` tensors (one per new token) -> one `[B, V]` tensor per new-token position, like
    `generate()`'s `scores` (a row that had finished contributes zeros)."""
    template = next(t for row in per_row for t in row)
    return tuple(
        torch.cat([row[i] if i < len(row) else torch.zeros_like(template) for row in per_row])
        for i in range(length)
    )


def treeflash_generate(
    target,
    drafter,
    input_ids: torch.LongTensor,
    attention_mask: torch.LongTensor | None = None,
    max_new_tokens: int = 128,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    streamer=None,
    stopping_criteria: StoppingCriteriaList | None = None,
    candidate_generator: TreeDrafter | None = None,
    **tree_options,
) -> TreeFlashGenerateOutput:
    """Plain-function API (no `generate()`): TreeFlash-decode the left-padded batch `input_ids [B, S]`
    (`attention_mask [B, S]` marks the padding; a batch needs `pad_token_id` for rows that finish first).

    `tree_options` are `tree_mode`, `tree_budget`, `tree_top_m`, `tree_top_k`, `tree_lookup` (defaults from the
    drafter); `stopping_criteria` are checked after every token, like `generate()`'s.
    Returns a `TreeFlashGenerateOutput` with `sequences [B, S + new]` and the per-step statistics.
    """
    unknown = set(tree_options) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"Unknown options {sorted(unknown)}; tree options are {OPTION_NAMES}.")
    processors = LogitsProcessorList()
    if do_sample:
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if top_k:
            processors.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
    criteria = StoppingCriteriaList([MaxLengthCriteria(input_ids.shape[1] + max_new_tokens)])
    criteria.extend(stopping_criteria or [])
    if eos_token_id is not None:
        criteria.append(EosTokenCriteria(eos_token_id))
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p} if do_sample else {}
    config = GenerationConfig(
        do_sample=do_sample, max_length=input_ids.shape[1] + max_new_tokens, return_dict_in_generate=True,
        pad_token_id=pad_token_id, **sampling
    )
    options = TreeOptions.resolve(drafter, tree_options)
    return treeflash_decode(
        target,
        input_ids,
        processors,
        criteria,
        config,
        drafter=drafter,
        options=options,
        streamer=streamer,
        candidate_generator=candidate_generator,
        attention_mask=attention_mask,
        position_ids=None if attention_mask is None else (attention_mask.cumsum(-1) - 1).clamp(min=0),
    )
