"""The bench's bookkeeping (τ arithmetic, identity check, JSON schema, prompt files) and the auto budget."""

import json

import pytest
import torch

from treeflash_hf.tools.bench import Method, PromptFileError, load_prompts, parse_methods, plot, run_bench
from treeflash_hf.engine.budget import AutoBudget
from treeflash_hf.recipes.testing import matching_drafter, random_target
from treeflash_hf.engine.tree import chain_tree

from .conftest import randomise_ar_layer


class ByteTokenizer:
    """Characters as token ids (enough for the bench on a random model)."""

    pad_token_id = 0

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = [1 + (ord(c) % 200) for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


@pytest.fixture(autouse=True)
def shared_cost_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path_factory.getbasetemp() / "treeflash-cache"))


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    target = random_target("qwen3", seed=0)
    drafter = randomise_ar_layer(matching_drafter(target, seed=1))
    draft_lm = random_target("qwen3", num_layers=1, seed=2)
    return target, drafter, draft_lm


def test_bench_report_schema_tau_and_identity(models, tmp_path):
    target, drafter, draft_lm = models
    methods = parse_methods(["hf_assisted", "prompt_lookup", "hf_dflash", "chain", "treeflash", "auto",
                             "treeflash+lookup", "auto+lookup"], [4, 8])
    assert methods[0].label == "autoregressive"
    report = run_bench(target, drafter, draft_lm, ByteTokenizer(), ["def f(x):", "import os\n"], methods,
                       max_new_tokens=10, temperature=0.0, repeats=2, progress=False)
    json.dumps(report)  # serialisable
    results = report["results"]
    assert set(results) == {"autoregressive", "hf_assisted", "prompt_lookup", "hf_dflash", "chain@4", "chain@8",
                            "treeflash@4", "treeflash@8", "auto@auto", "treeflash+lookup@4", "treeflash+lookup@8",
                            "auto+lookup@auto"}
    for label, row in results.items():
        for key in ("tau", "tokens_per_s", "speedup", "accepted_len_histogram", "n_prompts", "new_tokens",
                    "identical_to_autoregressive"):
            assert key in row, (label, key)
        assert row["n_prompts"] == 2 and row["new_tokens"] == 20
        assert row["identical_to_autoregressive"] == "yes" and row["identical_rows"] == 2
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
    ar = results["autoregressive"]
    assert ar["tau"] == pytest.approx(1.0) and ar["speedup"] == pytest.approx(1.0)
    for label in ("chain@4", "treeflash@8"):
        histogram = {int(k): v for k, v in results[label]["accepted_len_histogram"].items()}
        steps = sum(histogram.values())
        accepted = sum(k * v for k, v in histogram.items())
        # τ = (new tokens - 1 per prompt) / verification steps = 1 + mean accepted, when no step is cut short
        assert results[label]["tau"] == pytest.approx((20 - 2) / steps, rel=1e-6)
        assert results[label]["tau"] <= 1 + accepted / steps + 1e-9
    written = plot(report, tmp_path / "plots")
    assert all(p.exists() and p.stat().st_size > 1000 for p in written)


def test_lookup_methods_pass_the_lookup_length_and_chain_has_none():
    from treeflash_hf.tools.bench import LOOKUP_LENGTH, generate_kwargs

    with_lookup, without = parse_methods(["treeflash+lookup", "treeflash"], [8])[1:]
    assert generate_kwargs(with_lookup, "drafter", None)["tree_lookup"] == LOOKUP_LENGTH
    assert generate_kwargs(without, "drafter", None)["tree_lookup"] == 0
    with pytest.raises(SystemExit, match="chain\\+lookup"):
        parse_methods(["chain+lookup"], [8])


def test_identity_check_catches_a_different_output(models, monkeypatch):
    target, drafter, draft_lm = models
    import treeflash_hf.tools.bench as bench

    original = bench.run_method

    def corrupting(target, inputs, method, *args):
        out, seconds, forwards, accepted, row_steps = original(target, inputs, method, *args)
        if method.name == "chain":
            out = out.clone()
            out[0, -1] = (out[0, -1] + 1) % 256
        return out, seconds, forwards, accepted, row_steps

    monkeypatch.setattr(bench, "run_method", corrupting)
    report = run_bench(target, drafter, draft_lm, ByteTokenizer(), ["abc"], [Method("autoregressive"),
                       Method("chain", 4)], max_new_tokens=6, temperature=0.0, repeats=1, progress=False)
    assert report["results"]["chain@4"]["identical_to_autoregressive"] == "NO"
    assert report["results"]["chain@4"]["divergent_rows"] == 1
    assert report["results"]["autoregressive"]["identical_to_autoregressive"] == "yes"


def test_batched_bench_compares_every_row_with_batch_one_decoding(models):
    target, drafter, draft_lm = models
    target.generation_config.pad_token_id = 0
    methods = parse_methods(["hf_assisted", "treeflash", "auto+lookup"], [8])
    report = run_bench(target, drafter, draft_lm, ByteTokenizer(), ["def f(x):", "import os\n", "x = 1", "ab"],
                       methods, max_new_tokens=8, temperature=0.0, repeats=1, progress=False, batch_size=3)
    results = report["results"]
    assert "hf_assisted" not in results  # transformers' assisted loop takes one sequence at a time
    assert report["batch_size"] == 3
    for row in results.values():
        assert row["n_prompts"] == 4 and row["new_tokens"] == 32
        assert row["identical_rows"] + row["near_tie_rows"] == 4 and row["divergent_rows"] == 0
    assert results["autoregressive"]["tau"] == pytest.approx(1.0)
    assert results["treeflash@8"]["tau"] >= 1.0


def test_tie_tolerance_follows_the_dtype():
    from treeflash_hf.tools.bench import tie_tolerance

    assert tie_tolerance(torch.bfloat16, 16.0) == 2 * 2**-7 * 16  # two bf16 units in the last place at 16
    assert tie_tolerance(torch.bfloat16, 0.75) == 2 * 2**-7 * 0.5
    assert tie_tolerance(torch.float32, 16.0) == 1e-5  # float32: the 1e-5 threshold of the tests


def test_divergence_gap_is_taken_on_the_scores_decoding_used(models):
    """With a logits processor (the demo's repetition penalty), a near-tie is judged on the processed scores, as
    plain decoding chose on them, not on the raw logits."""
    from transformers import LogitsProcessorList

    from treeflash_hf.tools.bench import first_divergence_gap, tie_tolerance

    target = models[0]
    vocab = target.config.vocab_size
    prompt = torch.tensor([5, 6, 7])
    raw_gap, _ = first_divergence_gap(target, prompt, [1, 2], [1, 3])
    # a processor whose scores are 0.5 apart at the top: the gap must be that, whatever the raw logits were
    flat = LogitsProcessorList([lambda ids, scores: torch.arange(vocab, dtype=scores.dtype)[None] * 0.5])
    gap, tolerance = first_divergence_gap(target, prompt, [1, 2], [1, 3], flat)
    assert gap == pytest.approx(0.5) and gap != pytest.approx(raw_gap)
    assert tolerance == tie_tolerance(torch.float32, (vocab - 1) * 0.5)  # at the processed top score


def test_divergence_gap_counts_a_tie_in_either_forward_shape():
    """bfloat16 rounds a position's logits differently in a forward over the prefix and in one over the whole
    reference: a tie in either is a tie (the smaller gap counts), and a clear gap in both stays one."""
    from types import SimpleNamespace

    from treeflash_hf.tools.bench import first_divergence_gap

    class ShapeDependent(torch.nn.Module):
        dtype = torch.bfloat16

        def __init__(self, gap_by_length: dict[int, float]):
            super().__init__()
            self.gap_by_length = gap_by_length

        def forward(self, ids):
            logits = torch.zeros(1, ids.shape[1], 8)
            logits[..., 3] = 4.0
            logits[..., 5] = 4.0 - self.gap_by_length[ids.shape[1]]
            return SimpleNamespace(logits=logits)

    prompt = torch.tensor([1, 2])
    expected, got = [3, 3, 3, 3], [3, 5, 3, 3]  # they part at new token 1: prefix length 3, whole length 6
    gap, tolerance = first_divergence_gap(ShapeDependent({3: 0.1875, 6: 0.03125}), prompt, expected, got)
    assert (gap, tolerance) == (0.03125, 0.0625)  # two bf16 units at 4: a tie in the longer forward
    gap, _ = first_divergence_gap(ShapeDependent({3: 0.03125, 6: 0.1875}), prompt, expected, got)
    assert gap == 0.03125
    gap, tolerance = first_divergence_gap(ShapeDependent({3: 0.5, 6: 0.25}), prompt, expected, got)
    assert gap == 0.25 and gap > tolerance  # beyond a tie in both shapes: still reported as such


def test_prompt_files(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert load_prompts(str(good)) == ["a", "b"]
    with pytest.raises(PromptFileError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(PromptFileError, match="bad.jsonl:2: not valid JSON"):
        load_prompts(str(bad))
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"text": "a"}\n')
    with pytest.raises(PromptFileError, match='string "prompt" field'):
        load_prompts(str(wrong))
    assert len(load_prompts("humaneval", 3)) == 3


def test_auto_budget_learns_widths_from_accepted_paths():
    chain = chain_tree(0, torch.arange(1, 16), torch.full((15,), -0.05))  # 16 nodes: root and a 15-token chain
    budget = AutoBudget({1: 1.0, 16: 1.0}, explore_every=10**6, prior_weight=0.0)
    # what verifying each prefix would have yielded: node p adds a token exactly when it is on the accepted path
    budget.observe([8], [[1, 2, 3]], seconds=1.5)
    assert budget.expected_tokens(8) == [1, 2, 3, 4, 4, 4, 4, 4]
    assert budget.overhead[1] == pytest.approx(0.5)  # the step's time besides the measured verification cost
    # rows that verified fewer places do not count against the places they never had
    budget.observe([8, 4], [[1, 2, 3, 4, 5], [1]], seconds=1.5)
    rates = budget.accepted_sums[:8] / budget.verified_sums[:8]
    assert rates[1].item() == pytest.approx(1.0)
    assert rates[2].item() == pytest.approx((0.99 * 1 + 0.5) / (0.99 * 1 + 1.0))  # both rows verified place 2
    assert rates[4].item() == pytest.approx(0.5 / (0.99 * 1 + 0.5))  # only the 8-node row verified place 4
    # a place verified on few steps is shrunk toward the drafter's probability of its path over those steps (toward
    # "never accepted" where none is known)
    shrunk = AutoBudget({1: 1.0, 16: 1.0}, explore_every=10**6, prior_weight=1.0)
    shrunk.observe([4], [[1, 2, 3]], seconds=1.5)
    assert shrunk.expected_tokens(4) == [1, 1.5, 2, 2.5]
    informed = AutoBudget({1: 1.0, 16: 1.0}, explore_every=10**6, prior_weight=1.0)
    informed.observe([4, 2], [[1], []], seconds=1.5, path_probs=torch.tensor([[1.0, 0.8, 0.5, 0.3], [1.0, 0.6, 0, 0]]))
    # place 1: both rows, 1 of 2 accepted, predicted 0.7; places 2-3: the first row only, not accepted
    assert informed.expected_tokens(4) == pytest.approx([1, 1 + (0.5 + 0.7) / 2, 1.6 + 0.5 / 1.5, 1.6 + (0.5 + 0.3) / 1.5])

    def trained(curve: dict[int, float], depth: int, rows: int = 1, **options) -> AutoBudget:
        """A settled budget (no exploration due) that has seen `depth` drafted tokens accepted on every step of
        16-node trees."""
        learned = AutoBudget(curve, **{"explore_every": 10**6, **options})
        for _ in range(20):
            learned.observe([16] * rows, [list(range(1, depth + 1))] * rows, seconds=0.1 + curve[1])
        learned.until_explore = 10**6
        return learned

    def step_width(budget: AutoBudget, trees: list, share=None) -> int:
        budget.plan(len(trees), share=share)
        return budget.choose(trees)

    # verification nearly free (a GPU): every accepted place is worth verifying, nothing past the last
    assert step_width(trained({1: 1.0, 16: 1.05}, depth=10), [16]) == 11
    # ... and where a wider tree costs nothing more, the last width stays: no width beats it by the margin
    assert step_width(trained({1: 1.0, 16: 1.0}, depth=10), [16]) == 16
    # every extra token very costly: plain width 1
    assert step_width(trained({1: 1.0, 2: 10.0, 16: 200.0}, depth=10), [16]) == 1
    # a batch pays for all rows' tokens together, so each row's width shrinks as the batch grows
    curve = {1: 1.0, 4: 1.05, 8: 1.1, 16: 1.3, 32: 2.0, 64: 4.0, 128: 8.0}  # flat, then linear in total tokens
    widths = [step_width(trained(curve, depth=12, rows=rows), [16] * rows) for rows in (1, 2, 4, 8)]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1], widths
    # an ordinary step builds exactly the width it verifies; before anything is measured the step explores: it
    # builds a quarter more than the width (at least 4 nodes, at least 8 in all) and verifies all it built
    settled = trained(curve, depth=12)
    assert settled.plan() == settled.planned == 13 and not settled.exploring
    warming = AutoBudget(curve)  # the first warmup_steps steps all explore: one step's path says little
    for _ in range(warming.warmup_steps):
        assert warming.plan() == 20 and warming.exploring
        warming.observe([warming.choose([16])], [[1]], seconds=2.0)
    assert warming.plan() < 16 and not warming.exploring
    fresh = AutoBudget(curve, explore_every=3, warmup_steps=1)
    assert fresh.plan() == 20 and fresh.exploring
    assert fresh.choose([10]) == 10
    fresh.observe([10], [[1]], seconds=2.0)
    assert step_width(fresh, [16]) < 10 and step_width(fresh, [16]) < 10  # steps 2 and 3: exploit
    assert step_width(fresh, [16]) == 16 and fresh.exploring  # step 4 explores
    # explorations after which the width stays come ever further apart (up to max_explore_every); a change of
    # width brings them back to explore_every
    backoff = trained(curve, depth=12, explore_every=2, max_explore_every=8)
    backoff.last_best, backoff.until_explore = 13, 0  # settled at its width, an exploration due
    explored = []
    for _ in range(40):
        width = step_width(backoff, [16])
        explored.append(backoff.exploring)
        backoff.observe([width], [list(range(1, 13))], seconds=0.1 + curve[1])
    explored_at = [i for i, exploring in enumerate(explored) if exploring]
    gaps = [later - earlier for earlier, later in zip(explored_at, explored_at[1:])]
    assert gaps[:3] == [2, 4, 8] and set(gaps[3:]) == {8}, gaps
    assert backoff.last_best == 13
    backoff.last_best = 20  # as if the text had needed 20 until now: the width moves back to 13 ...
    backoff.until_explore = 10
    assert step_width(backoff, [16]) == 13 and backoff.explore_wait == 2  # ... and explorations come often
    # under tensor parallelism the shared (rank 0's) width is the one used and remembered
    shared = trained(curve, depth=12)
    assert step_width(shared, [16], share=lambda width: 3) == 3 and shared.last_best == 3
    shared.until_explore = 0
    assert shared.plan(share=lambda width: 3) == 8  # exploring: at least 8, else a quarter more (at least 4)
    wide = trained(curve, depth=12)
    wide.until_explore = 0
    assert wide.plan(share=lambda width: 40) == 50
    # a width forced by trees cut short (the end of a call) is used, not remembered for the next call
    wide.last_best, wide.until_explore = 40, 10
    assert step_width(wide, [6], share=lambda width: 40) == 6 and wide.last_best == 40
    assert step_width(wide, [16]) < 16 and wide.last_best < 16  # an ordinary choice is remembered


def test_auto_budget_costs_verification_and_drafting_as_measured_at_each_batch_size():
    """Continuous batching's failure mode: a batch's verification costs more than the one-row curve says, and deep
    blocks cost more to draft; counted as a fixed overhead, both made the widths of large batches grow."""
    chain = chain_tree(0, torch.arange(1, 16), torch.full((15,), -0.05))
    curve = {1: 0.05, 8: 0.06, 16: 0.07, 32: 0.09, 64: 0.13, 128: 0.21}  # flat, then linear in total tokens

    def settled(rows: int, verify_factor: float, seconds_per_position: float) -> AutoBudget:
        """Steps of `rows` rows whose accepted paths run 0..12 nodes deep (rates falling with the place),
        verification `verify_factor` times the curve, drafting 5 ms per row plus `seconds_per_position` per drafted
        position and row; widths 8 and 12 alternate so that the rest of a step varies with its depth."""
        budget = AutoBudget(curve, explore_every=10**6, warmup_steps=0, prior_weight=1.0)  # (no path probabilities)
        for step in range(40):
            width = (8, 12)[step % 2]
            paths = [list(range(1, 1 + min(width - 1, (row + step) % 13))) for row in range(rows)]
            verify = verify_factor * budget.verify_cost(rows * width)
            drafting = rows * (0.005 + seconds_per_position * (width - 1))
            budget.observe([width] * rows, paths, seconds=verify + drafting, verify_seconds=verify)
        budget.until_explore = 10**6
        return budget

    plain_costs = settled(8, verify_factor=1.0, seconds_per_position=0.0)
    assert plain_costs.verify_scale[8] == pytest.approx(1.0) and plain_costs.depth_cost == pytest.approx(0, abs=1e-9)
    assert plain_costs.overheads(8, 2) == pytest.approx([0.04, 0.04])  # 8 rows x 5 ms, whatever the width
    measured = settled(8, verify_factor=1.5, seconds_per_position=0.002)
    assert measured.verify_scale[8] == pytest.approx(1.5)
    assert measured.depth_cost == pytest.approx(0.002)  # fitted from the spread of depths at one batch size
    overheads = measured.overheads(8, 12)
    assert overheads[11] - overheads[7] == pytest.approx(8 * 0.002 * 4)  # 4 more positions for 8 rows
    # both costs counted: a narrower width for the batch, each of them alone narrows it too
    assert measured.plan(8) < plain_costs.plan(8)
    assert settled(8, 1.5, 0.0).plan(8) < plain_costs.plan(8) and settled(8, 1.0, 0.002).plan(8) < \
        plain_costs.plan(8)
    # a batch size never measured takes the nearest one's figures, the overhead in proportion to the rows
    assert measured.overheads(4, 12) == pytest.approx([overhead / 2 for overhead in overheads])
    # the step scheduler trying the drafted kind asks for the width it would use: a due exploration waits
    measured.until_explore = 0
    assert measured.plan(8, may_explore=False) == measured.planned and not measured.exploring
    assert measured.plan(8) > measured.planned and measured.exploring
    # past the drafter's block, wider trees draft no deeper: no more drafting cost
    measured.max_depth = 9
    assert measured.overheads(8, 12)[9:] == pytest.approx([measured.overheads(8, 12)[9]] * 3)
    # nor past the depths the step scores up front (recent trees' depth): its plan says how many
    measured.plan(8, depth_cap=5)
    assert measured.drafted_depth_of(12) == 5
    assert measured.overheads(8, 12)[5:] == pytest.approx([measured.overheads(8, 12)[5]] * 7)


def test_the_cost_curve_is_measured_as_steps_run_and_slow_moments_are_measured_again(models, monkeypatch):
    """A verify step appends to the engine's growing cache and its width changes little from step to step: the
    curve is timed so (on a plain cache, and with every forward at a new size, a 2-core host's curve was out of
    shape by up to 1.5x). A size timed slower than a larger one (a slow moment) is measured again."""
    import time as clock

    from treeflash_hf.engine import budget as budget_module
    from treeflash_hf.engine.cache import GrowingLayer

    target = models[0]
    calls, slow = [], {"size": 3, "left": 6}

    def recorded(module, args, kwargs):  # (a hook on the model: it sees every forward, whichever runs it)
        input_ids, cache = args[0] if args else kwargs["input_ids"], kwargs["cache"]
        calls.append((input_ids.shape[1], all(type(layer) is GrowingLayer for layer in cache.layers)))
        if input_ids.shape[1] == slow["size"] and slow["left"] and len(calls) > 1:  # its first pass runs slow
            slow["left"] -= 1
            clock.sleep(0.05)

    hook = target.register_forward_pre_hook(recorded, with_kwargs=True)
    sizes = (1, 2, 3, 4, 6)
    try:
        costs = budget_module.measure_verify_cost(target, sizes=sizes, past_len=16, repeats=2, block=2)
    finally:
        hook.remove()
    assert all(on_growing_cache for _, on_growing_cache in calls)
    timed = [size for size, _ in calls[1:]]  # (after the prefix)
    # each size three forwards in a row (one untimed), ascending then descending; then again the sizes timed slower
    # than a larger one: size 3 (and any other a tiny model's ~1 ms forwards happened to time so)
    rounds = [n for n in sizes for _ in range(3)] + [n for n in sizes[::-1] for _ in range(3)]
    assert timed[: len(rounds)] == rounds
    again = timed[len(rounds):]
    assert 3 in again and again == [n for n in again[::3] for _ in range(3)]
    assert costs[3] < 0.02  # its slow figures (each over the 50 ms slept) lost to the repeat's
    assert set(costs) == set(sizes)


def test_auto_budget_fits_the_cost_per_depth_on_steps_that_scored_once():
    """A deepened step scores the whole block and searches its trees again, and a first call's first steps pay
    one-time work: both run deep (or wide) and slow for reasons other than depth. Read as a cost per depth they
    made narrow widths look cheap (on the SmolLM2 pair auto settled at width 4 where widths 6-10 ran faster)."""
    curve = {1: 0.05, 8: 0.06, 16: 0.07}

    def fitted(deepened_extra: float, first_call_extra: float) -> AutoBudget:
        """Widths 6 and 8 alternate, the rest of a step 5 ms + 0.5 ms per scored depth; every fifth step is
        deepened (the whole block's 15 depths, `deepened_extra` more), the first four pay `first_call_extra`."""
        budget = AutoBudget(curve, explore_every=10**6, warmup_steps=4)
        for step in range(60):
            width, deepened = (6, 8)[step % 2], step % 5 == 4
            depth = 15 if deepened else width - 1
            rest = 0.005 + 0.0005 * depth + deepened * deepened_extra + (step < 4) * first_call_extra
            verify = budget.verify_cost(width)
            budget.observe([width], [list(range(1, 3))], seconds=verify + rest, verify_seconds=verify,
                           drafted_depth=depth, deepened=deepened)
        return budget

    clean = fitted(0.0, 0.0)
    assert clean.depth_cost == pytest.approx(0.0005)
    slowed = fitted(deepened_extra=0.004, first_call_extra=0.03)
    assert slowed.depth_cost == pytest.approx(0.0005)
    # the deepened steps' time still counts in what a step costs: they happen at these widths
    assert slowed.overhead[1] > clean.overhead[1]


def test_auto_budget_decoding_is_lossless(models, tmp_path_factory):
    target, drafter, _ = models
    prompt = torch.tensor([[4, 8, 15, 16, 23, 42]])
    reference = target.generate(prompt, max_new_tokens=20, do_sample=False)
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False, tree_budget="auto",
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    cached = list((tmp_path_factory.getbasetemp() / "treeflash-cache").glob("verify-cost-*.json"))
    assert cached and all(float(v) > 0 for v in json.loads(cached[0].read_text()).values())


def test_a_drafted_step_the_scheduler_tries_is_planned_without_exploring(models, monkeypatch):
    """The step kind is chosen first; a drafted step that is the scheduler's try (not its best kind) asks auto
    for the width it would use, and only the scheduler's own best drafted steps may explore; lossless either way."""
    from treeflash_hf import forget_learned_state
    from treeflash_hf.engine.lookup import StepScheduler

    target, drafter, _ = models
    tries = iter([True, False] * 100)

    def choose(self, branches, **_):
        self.explored = next(tries)
        return "draft"

    asked = []
    plan = AutoBudget.plan
    monkeypatch.setattr(StepScheduler, "choose", choose)
    monkeypatch.setattr(AutoBudget, "plan", lambda self, rows=1, share=None, may_explore=True, depth_cap=None: (
        asked.append(may_explore), plan(self, rows, share, may_explore, depth_cap))[1])
    forget_learned_state(drafter)
    prompt = torch.tensor([[4, 8, 15, 16, 23, 42]])
    out = target.generate(prompt, assistant_model=drafter, max_new_tokens=24, do_sample=False, tree_budget="auto")
    forget_learned_state(drafter)
    assert torch.equal(out, target.generate(prompt, max_new_tokens=24, do_sample=False))
    assert len(asked) >= 4 and asked == [step % 2 == 1 for step in range(len(asked))]  # tries alternate


def test_eval_dist_report(models):
    from treeflash_hf.tools.evaluate import eval_distributions

    target, _, _ = models
    fresh = matching_drafter(target, seed=4)  # zero AR layer: TreeFlash's tables are DFlash's
    report = eval_distributions(target, fresh, [torch.tensor([[3, 9, 27, 81]])], continuation=8,
                                anchors_per_prompt=2, samples=16)
    assert report["depths"] == list(range(1, fresh.config.block_size))
    assert report["dflash"]["tvd"] == report["treeflash"]["tvd"]
    for source in ("dflash", "treeflash", "target_marginal"):
        assert all(0.0 <= v <= 1.0 for v in report[source]["tvd"])
        assert all(a <= b for a, b in zip(report[source]["top1"], report[source]["top5"]))
    trained = randomise_ar_layer(matching_drafter(target, seed=4), std=0.3)
    other = eval_distributions(target, trained, [torch.tensor([[3, 9, 27, 81]])], continuation=8,
                               anchors_per_prompt=2, samples=16)
    assert other["treeflash"]["tvd"] != other["dflash"]["tvd"]


def test_ablation_variants_share_the_backbone(models):
    from treeflash_hf.tools.ablate import VARIANTS, variant_drafter

    _, drafter, _ = models
    base = drafter.state_dict()
    for name, (overrides, _) in VARIANTS.items():
        variant = variant_drafter(drafter, overrides)
        state = variant.state_dict()
        assert all(torch.equal(state[k], v) for k, v in base.items() if not k.startswith("ar_approximation."))
        assert torch.count_nonzero(state["ar_approximation.d.weight"]) == 0, name
    assert variant_drafter(drafter, {"ar_num_prev_tokens": 2}).ar_approximation.ug.in_features == 3 * 64
    assert variant_drafter(drafter, {"ar_type": "linear"}).config.ar_type == "linear"


def test_cost_table_reports_measured_ratios(monkeypatch):
    """Every ratio of `profile --cost-table` comes from this run's own measurements."""
    import argparse

    from treeflash_hf.tools import profile

    measured = {}
    real = profile.measure_verify_cost

    def spy(target, sizes, past_len):
        measured.update(real(target, sizes=sizes, past_len=past_len, repeats=1))
        return dict(measured)

    monkeypatch.setattr(profile, "measure_verify_cost", spy)
    args = argparse.Namespace(vocab=64, block_size=4, drafter_layers=1, verify_sizes=[4, 8], prompt_len=16,
                              train_throughput=False)
    row = profile.cost_row(2, 64, torch.float32, args)
    assert row["token_ms"] == measured[1] * 1e3
    assert row["verify_ratio"] == {n: measured[n] / measured[1] for n in (4, 8)}
    assert row["drafter_ms"] > 0 and row["drafter_share"] == pytest.approx(row["drafter_ms"] / row["token_ms"])
    assert profile.training_throughput(random_target("qwen3", vocab_size=64, seed=0), torch.bfloat16, batch=2,
                                       seq_len=8, steps=1) > 0
