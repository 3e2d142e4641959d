"""The trainer: losses, frozen backbone, bit-exact resume, verifier KL and slot weights, data masks, errors."""

import math

import pytest
import torch

from treeflash_hf.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from treeflash_hf.training.data import MaskedSequences, TokenStream, build_self_distillation_set, stable_split
from treeflash_hf.training.drafter import DrafterLossConfig, drafter_loss, sample_anchors, train_drafter
from treeflash_hf.training.lm import train_lm
from treeflash_hf.training.loop import LoopConfig
from treeflash_hf.recipes.testing import matching_drafter, random_target
from treeflash_hf.engine.validation import TreeFlashInputError

from .conftest import randomise_ar_layer

VOCAB = 96


@pytest.fixture
def tiny():
    torch.set_num_threads(1)
    target = random_target("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                           seed=0)
    drafter = matching_drafter(target, num_layers=1, block_size=4, seed=1)
    # Structured data (a repeating pattern) so the losses can fall in a few steps.
    pattern = torch.tensor([3, 17, 5, 40, 22, 9, 61, 13] * 400)
    return target, drafter, TokenStream(pattern.numpy(), seq_len=24, seed=0)


def loop(tmp_path, name, steps, **kw):
    kw = {"eval_every": 1000, "save_every": 1000, **kw}
    return LoopConfig(run_dir=str(tmp_path / name), max_steps=steps, batch_size=4, lr=3e-3, warmup_steps=2, **kw)


def test_backbone_stage_loss_falls(tmp_path, tiny):
    target, drafter, data = tiny
    summary = train_drafter(target, drafter, data, [data.batch(999, 4)], DrafterLossConfig(stage="backbone",
                            num_anchors=4), loop(tmp_path, "bb", 30))
    losses = [row["loss"] for row in summary["curve"]]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert torch.count_nonzero(drafter.ar_approximation.d.weight) == 0  # stage backbone leaves the AR layer


def test_ar_stage_keeps_frozen_backbone_bit_identical(tmp_path, tiny):
    target, drafter, data = tiny
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    summary = train_drafter(target, drafter, data, [data.batch(999, 4)], DrafterLossConfig(stage="ar",
                            num_anchors=4), loop(tmp_path, "ar", 20))
    after = drafter.state_dict()
    for name, value in before.items():
        if name.startswith("ar_approximation."):
            continue
        assert torch.equal(value, after[name]), name
    assert torch.count_nonzero(after["ar_approximation.d.weight"]) > 0
    losses = [row["loss"] for row in summary["curve"]]
    assert losses[-1] < losses[0]


def test_resume_continues_bit_for_bit(tmp_path, tiny):
    target, drafter, data = tiny
    initial = {k: v.clone() for k, v in drafter.state_dict().items()}
    config = DrafterLossConfig(stage="backbone", num_anchors=4)
    train_drafter(target, drafter, data, [], config, loop(tmp_path, "full", 8, save_every=4))
    uninterrupted = {k: v.clone() for k, v in drafter.state_dict().items()}

    drafter.load_state_dict(initial)

    class Interrupt(Exception):
        pass

    class Crashing:
        def batch(self, step, batch_size):
            if step == 5:
                raise Interrupt
            return data.batch(step, batch_size)

    with pytest.raises(Interrupt):
        train_drafter(target, drafter, Crashing(), [], config, loop(tmp_path, "split", 8, save_every=4))
    drafter.load_state_dict(initial)  # a fresh process would start from scratch weights
    train_drafter(target, drafter, data, [], config, loop(tmp_path, "split", 8, save_every=4, resume=True))
    resumed = drafter.state_dict()
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


def draft_vocab(kind: str) -> torch.LongTensor | None:
    """None; every token in a shuffled order; or half the tokens (the data pattern's among them)."""
    if kind == "none":
        return None
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))
    if kind == "all_shuffled":
        return order
    pattern = torch.tensor([3, 17, 5, 40, 22, 9, 61, 13])
    return torch.cat([pattern, order[~torch.isin(order, pattern)][: VOCAB // 2 - len(pattern)]])


@pytest.mark.parametrize("decay,vocab", [(0.5, "none"), (7.0, "none"), (7.0, "all_shuffled"), (7.0, "half")])
def test_loss_is_weighted_kl_to_the_verifier(tiny, decay, vocab):
    """Recompute the loss of one block independently: the target's distributions (not the data tokens), the
    drafter run through its inference path on exactly the context before the anchor, weights exp(-(k-1)/decay).
    With a draft vocabulary, `q` is over its tokens and `p` restricted to them (not renormalised)."""
    target, drafter, data = tiny
    drafter = randomise_ar_layer(drafter, std=0.3)
    token_ids = draft_vocab(vocab)
    if token_ids is not None:
        drafter.set_draft_vocab(token_ids)
    keep = slice(None) if token_ids is None else token_ids
    ids = data.batch(3, 1)
    config = DrafterLossConfig(stage="ar", num_anchors=1, decay=decay)
    loss, _ = drafter_loss(target, drafter, ids, config, torch.Generator().manual_seed(5))
    anchor = int(sample_anchors(1, ids.shape[1] - 1, 4, 1, torch.Generator().manual_seed(5))[0, 0])

    tokens = ids[:, :-1]
    layers = drafter.config.target_layer_ids
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        out = target(tokens, output_hidden_states=True)
        context = torch.cat([out.hidden_states[i + 1][:, :anchor] for i in layers], dim=-1)
        noise = embed(torch.tensor([[int(tokens[0, anchor])] + [drafter.config.mask_token_id] * 3]))
        h = drafter(noise_embeds=noise, context_hidden_states=context,
                    position_ids=torch.arange(0, anchor + 4)[None]).pre_norm_hidden_state[0]
        expected_num, expected_den = 0.0, 0.0
        for k in range(1, 4):
            p = torch.log_softmax(out.logits[0, anchor + k - 1].float(), -1)[keep]
            prev = embed(tokens[0, anchor + k - 1])
            q = torch.log_softmax(head(drafter.ar_corrected_hidden_states(h[k], prev))[keep].float(), -1)
            weight = math.exp(-(k - 1) / decay)
            expected_num += weight * float((p.exp() * (p - q)).sum())
            expected_den += weight
    assert loss.item() == pytest.approx(expected_num / expected_den, rel=1e-4, abs=1e-6)

    # The data token the last slot predicts (position anchor + 3) feeds nothing of this block but the label:
    # pure KL to the verifier ignores it, a CE share does not.
    changed = ids.clone()
    changed[0, anchor + 3] = (changed[0, anchor + 3] + 1) % VOCAB
    same, _ = drafter_loss(target, drafter, changed, config, torch.Generator().manual_seed(5))
    assert same.item() == pytest.approx(loss.item(), rel=1e-6)
    with_ce = DrafterLossConfig(stage="ar", num_anchors=1, decay=decay, ce_weight=0.5)
    a, _ = drafter_loss(target, drafter, ids, with_ce, torch.Generator().manual_seed(5))
    b, _ = drafter_loss(target, drafter, changed, with_ce, torch.Generator().manual_seed(5))
    assert a.item() != pytest.approx(b.item(), rel=1e-6)


def test_lm_training_loss_falls(tmp_path, tiny):
    target, _, data = tiny
    summary = train_lm(target.train(), data, {"held": (data, 3.0)}, loop(tmp_path, "lm", 25, eval_every=25))
    losses = [row["loss"] for row in summary["curve"]]
    assert losses[-1] < 0.7 * losses[0]
    last = summary["curve"][-1]
    assert last["eval_held_bits_per_byte"] == pytest.approx(last["eval_held_ce_nats"] / math.log(2) / 3.0)


def test_self_distillation_masks_cover_only_responses(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<pad>", "<mask>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", pad_token="<pad>",
                                        mask_token="<mask>")
    target = random_target("qwen3", vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=2,
                           num_kv_heads=1, seed=0)
    prompts = ["def f(x):", "return", "def f(x):\n    return x + 1"]
    dataset = build_self_distillation_set(target, tokenizer, prompts, tmp_path / "sd", max_new_tokens=6,
                                          batch_size=2)
    assert len(dataset) == 3
    for prompt, row in zip(prompts, dataset):
        prompt_ids = tokenizer(prompt)["input_ids"]
        assert row["input_ids"][: len(prompt_ids)] == prompt_ids
        assert row["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(row["input_ids"]) - len(prompt_ids))
        assert tokenizer.pad_token_id not in row["input_ids"][len(prompt_ids):]
    import datasets

    reloaded = datasets.load_from_disk(str(tmp_path / "sd"))
    ids, mask = MaskedSequences(reloaded, seq_len=8, pad_token_id=tokenizer.pad_token_id).batch(0, 2)
    assert ids.shape == mask.shape == (2, 9)


def test_corrupt_checkpoint_and_mismatched_target(tmp_path, tiny):
    target, drafter, data = tiny
    path = save_checkpoint(tmp_path / "run", 3, {"model": drafter.state_dict()}, {})
    (path / "state.pt").write_bytes((path / "state.pt").read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(path)
    other = random_target("qwen3", vocab_size=VOCAB, hidden_size=48, num_layers=3, num_heads=2, num_kv_heads=1)
    with pytest.raises(TreeFlashInputError, match="hidden_size"):
        train_drafter(other, drafter, data, [], DrafterLossConfig(), loop(tmp_path, "x", 2))


def test_stable_split_is_deterministic():
    assert stable_split("json/decoder.py") == stable_split("json/decoder.py")
    splits = [stable_split(f"pkg/module_{i}.py") for i in range(400)]
    assert 0 < splits.count("heldout") < 60


def test_train_command_end_to_end(tmp_path):
    """`treeflash-hf train` from a saved target and a token stream, then `--resume` is accepted."""
    import numpy as np

    from treeflash_hf.cli import main

    target = random_target("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1)
    target.save_pretrained(tmp_path / "target")
    np.save(tmp_path / "tokens.npy", np.array([3, 17, 5, 40, 22, 9, 61, 13] * 100))
    args = ["train", "--stage", "backbone", "--target", str(tmp_path / "target"), "--data",
            str(tmp_path / "tokens.npy"), "--heldout", str(tmp_path / "tokens.npy"), "--out", str(tmp_path / "run"),
            "--steps", "4", "--batch-size", "2", "--seq-len", "24", "--num-anchors", "2", "--drafter-layers", "1",
            "--block-size", "4", "--mask-token-id", str(VOCAB - 1), "--eval-every", "2", "--device", "cpu"]
    assert main(args) == 0
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    assert main(args + ["--resume"]) == 0  # nothing left to do: resumes at the last step and saves again


def test_train_recalibrates_against_a_quantized_target(tmp_path, monkeypatch):
    """`train --stage ar --target-quant SPEC` trains against the quantized target: its forward is the one the loss
    runs (not the dense weights on disk)."""
    import numpy as np

    pytest.importorskip("torchao")
    from treeflash_hf.integrations import quantize
    from treeflash_hf.cli import main

    random_target("llama", vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=2,
                  num_kv_heads=1).save_pretrained(tmp_path / "target")
    np.save(tmp_path / "tokens.npy", np.array([3, 17, 5, 40, 22, 9, 61, 13] * 100))
    quantized = []
    original = quantize.quantize_target

    def recording(target, spec, **kwargs):
        quantized.append(spec)
        return original(target, spec, **kwargs)

    monkeypatch.setattr(quantize, "quantize_target", recording)
    assert main(["train", "--stage", "ar", "--target-quant", "torchao-int8", "--target", str(tmp_path / "target"),
                 "--data", str(tmp_path / "tokens.npy"), "--out", str(tmp_path / "run"), "--steps", "2",
                 "--batch-size", "2", "--seq-len", "24", "--num-anchors", "2", "--drafter-layers", "1",
                 "--block-size", "4", "--mask-token-id", str(VOCAB - 1), "--device", "cpu"]) == 0
    assert quantized == ["torchao-int8"] and (tmp_path / "run" / "final" / "model.safetensors").exists()


def test_train_command_seed_fixes_the_whole_run(tmp_path):
    """Two runs of the same `treeflash-hf train` command (a new drafter each) end with equal weights; another
    `--seed` gives other weights."""
    import numpy as np
    from safetensors.torch import load_file

    from treeflash_hf.cli import main

    random_target("qwen3", vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=2,
                  num_kv_heads=1).save_pretrained(tmp_path / "target")
    np.save(tmp_path / "tokens.npy", np.array([3, 17, 5, 40, 22, 9, 61, 13] * 100))

    def train(name: str, seed: int) -> dict:
        assert main(["train", "--stage", "backbone", "--target", str(tmp_path / "target"), "--data",
                     str(tmp_path / "tokens.npy"), "--out", str(tmp_path / name), "--steps", "3", "--batch-size", "2",
                     "--seq-len", "24", "--num-anchors", "2", "--drafter-layers", "1", "--block-size", "4",
                     "--mask-token-id", str(VOCAB - 1), "--seed", str(seed), "--device", "cpu"]) == 0
        return load_file(tmp_path / name / "final" / "model.safetensors")

    first, again, other = train("a", 5), train("b", 5), train("c", 6)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["fc.weight"], other["fc.weight"])


def test_shards_split_every_batch_exactly_once():
    from treeflash_hf.training.loop import Shard

    for batch_size in (2, 5, 8):
        for count in (1, 2, 3):
            rows = [list(range(batch_size))[Shard(index, count).rows(batch_size)] for index in range(count)]
            assert sum(rows, []) == list(range(batch_size))
            assert max(map(len, rows)) - min(map(len, rows)) <= 1


def test_anchors_fall_where_the_loss_mask_counts():
    mask = torch.zeros(3, 41)
    mask[0, 30:] = 1  # a response from position 30
    mask[2, 5:12] = 1
    anchors = sample_anchors(3, 40, 4, 64, torch.Generator().manual_seed(0), mask)
    assert anchors.shape == (3, 64)
    assert bool(((anchors[0] >= 29) & (anchors[0] <= 36)).all())  # the first drafted token (a + 1) is in it
    assert bool(((anchors[2] >= 4) & (anchors[2] <= 10)).all())
    assert bool(((anchors[1] >= 1) & (anchors[1] <= 36)).all()) and anchors[1].unique().numel() > 10  # no mask: all


def test_finished_schedule_continues_at_its_floor_learning_rate(tmp_path, tiny):
    from treeflash_hf.training.loop import lr_factor

    cosine = LoopConfig(run_dir="x", max_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    extended = LoopConfig(run_dir="x", max_steps=160, warmup_steps=10, min_lr_ratio=0.1, cosine_steps=100)
    assert [lr_factor(s, extended) for s in range(100)] == [lr_factor(s, cosine) for s in range(100)]
    assert all(lr_factor(s, extended) == pytest.approx(0.1) for s in range(100, 160))


@pytest.mark.parametrize("replan", [False, True])
def test_a_replanned_schedule_ends_its_cosine_with_the_time_budget(tmp_path, monkeypatch, replan):
    import types

    from treeflash_hf.training import loop as loop_module
    from treeflash_hf.training.loop import LossTerms, train_loop

    clock = [0.0]
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(time=lambda: clock[0]))
    model = torch.nn.Linear(2, 1)

    def loss_fn(step, shard):
        clock[0] += 1.0  # every step takes one second of the fake clock
        return LossTerms(loss_sum=model(torch.ones(1, 2)).pow(2).sum(), weight=1.0)

    # a probe planned 10 steps for a minute, but 60 fit it
    config = LoopConfig(run_dir=str(tmp_path / "run"), max_steps=10, max_minutes=1.0, warmup_steps=2, save_every=5,
                        eval_every=1000, replan=replan)
    summary = train_loop(model, loss_fn, None, config)
    if not replan:
        assert summary["steps"] == 10
        return
    assert 58 <= summary["steps"] <= 62
    assert summary["curve"][-1]["lr"] == pytest.approx(config.lr * config.min_lr_ratio, rel=0.05)
    assert summary["curve"][30]["lr"] > 0.4 * config.lr  # mid-budget, mid-cosine: not already at the floor
    from treeflash_hf.training.checkpoint import latest_checkpoint, load_checkpoint

    assert config.max_steps == 10  # the caller's config is left as given
    assert 58 <= load_checkpoint(latest_checkpoint(tmp_path / "run"))["max_steps"] <= 62  # a resume keeps the plan


def test_drafter_init_copies_weights_or_names_the_mismatch(tmp_path, tiny):
    from treeflash_hf.recipes.tiny_suite import load_drafter_weights

    target, drafter, _ = tiny
    drafter.save_pretrained(tmp_path / "earlier")
    fresh = matching_drafter(target, num_layers=1, block_size=4, seed=7)
    load_drafter_weights(fresh, tmp_path / "earlier")
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), drafter.state_dict().values()))
    deeper = matching_drafter(target, num_layers=2, block_size=4, seed=7)
    with pytest.raises(ValueError, match="do not fit this drafter's shape"):
        load_drafter_weights(deeper, tmp_path / "earlier")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_drafter_weights(fresh, tmp_path / "missing")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_new_drafter_can_start_from_the_target_s_last_layers(arch):
    """`layer_init="target"`: the drafter's decoder layers are copies of the target's last ones (weights the
    target's layer lacks, a Llama layer's q/k norms, keep their initialisation), its final norm the target's; a
    drafter deeper than the target is refused."""
    from treeflash_hf.training.drafter import new_drafter

    target = random_target(arch, vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1, seed=0)
    drafter = new_drafter(target, 2, block_size=4, mask_token_id=1, layer_init="target")
    source = target.get_decoder()
    for layer, copied in zip(drafter.layers, source.layers[1:]):
        theirs = copied.state_dict()
        for name, value in layer.state_dict().items():
            if name in theirs:
                assert torch.equal(value, theirs[name]), name
            else:
                assert arch == "llama" and "_norm" in name
    assert torch.equal(drafter.norm.weight, source.norm.weight)
    fresh = new_drafter(target, 2, block_size=4, mask_token_id=1)
    assert not torch.equal(fresh.layers[0].self_attn.q_proj.weight, drafter.layers[0].self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="only 3"):
        new_drafter(target, 4, block_size=4, mask_token_id=1, layer_init="target")


def test_an_exported_summary_keeps_evaluated_rows_every_tenth_step_and_the_last():
    from treeflash_hf.recipes.drafter_recipe import thinned_curve

    curve = [{"step": s, "loss": 1.0 / s} for s in range(1, 26)]
    curve[6]["eval_ar_kl"] = 0.5  # step 7 was evaluated
    stage = {"steps": 25, "minutes": 1.0, "curve": curve}
    thinned = thinned_curve(stage)
    kept = thinned["curve"]
    assert [row["step"] for row in kept] == [7, 10, 20, 25]
    assert kept[0]["eval_ar_kl"] == 0.5 and kept[-1]["loss"] == 1.0 / 25
    assert stage["curve"] is curve and len(curve) == 25  # the work folder's summary is left whole
    assert {k: v for k, v in thinned.items() if k != "curve"} == {"steps": 25, "minutes": 1.0}


def test_a_grown_drafter_drafts_as_before_and_trains_its_new_layers(tiny, capsys):
    """`with_identity_layers`: the appended layers start as the identity (zero output projections), so the grown
    drafter's outputs are the trained one's; gradients reach the new layers' weights, so training deepens it."""
    from treeflash_hf.training.drafter import with_identity_layers

    _, drafter, _ = tiny
    randomise_ar_layer(drafter, std=0.05)
    grown = with_identity_layers(drafter, 2)
    assert grown.config.num_hidden_layers == len(grown.layers) == 3 and drafter.config.num_hidden_layers == 1
    hidden = drafter.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(2, 4, hidden, generator=generator)
    context = torch.randn(2, 6, len(drafter.config.target_layer_ids) * hidden, generator=generator)
    positions = torch.arange(10).expand(2, -1)
    before = drafter(noise, context, position_ids=positions)
    after = grown(noise, context, position_ids=positions)
    assert torch.equal(before.last_hidden_state, after.last_hidden_state)
    after.last_hidden_state.square().sum().backward()
    new_layer = grown.layers[-1]
    assert new_layer.self_attn.o_proj.weight.grad.abs().sum() > 0 and new_layer.mlp.down_proj.weight.grad.abs().sum() > 0
    from treeflash_hf.cli import main

    assert main(["reference", "train-drafter", "--grow-layers", "1", "--stages", "backbone"]) == 1
    assert "give it with --init" in capsys.readouterr().err  # said before any model loads


def test_the_recipe_continues_a_trained_drafter_at_a_lower_peak_lr():
    """`reference train-drafter` leaves `--lr` unset at parse time: a continuation (`--init`) runs at `CONTINUED_LR`,
    a new drafter or a recalibration at `NEW_DRAFTER_LR`, and a given `--lr` always wins."""
    from treeflash_hf.cli import build_parser
    from treeflash_hf.recipes.drafter_recipe import CONTINUED_LR, NEW_DRAFTER_LR, peak_lr

    parse = build_parser().parse_args
    assert parse(["reference", "train-drafter"]).lr is None
    assert parse(["reference", "train-drafter", "--lr", "2e-4"]).lr == 2e-4
    assert CONTINUED_LR < NEW_DRAFTER_LR
    assert peak_lr(None, continuing=True) == CONTINUED_LR
    assert peak_lr(None, continuing=False) == NEW_DRAFTER_LR
    assert peak_lr(5e-5, continuing=False) == 5e-5


def test_the_recipe_computes_in_bfloat16_only_where_the_cpu_has_its_arithmetic(monkeypatch):
    """`--compute-dtype auto` (the default) runs the recipe's stages under bfloat16 autocast on a CPU only when it
    multiplies bfloat16 in hardware (`dtype="auto"`'s rule; AVX2 CPUs emulate it several times slower than float32);
    an explicit choice always wins, and the study parses the same flag."""
    from treeflash_hf.cli import build_parser
    from treeflash_hf.integrations import cpu_linear
    from treeflash_hf.recipes.drafter_recipe import uses_bfloat16

    target = torch.nn.Linear(4, 4)
    parse = build_parser().parse_args
    assert parse(["reference", "train-drafter"]).compute_dtype == "auto"
    assert parse(["reference", "drafter-study", "--compute-dtype", "float32"]).compute_dtype == "float32"
    for native in (True, False):
        monkeypatch.setattr(cpu_linear, "cpu_has_native", lambda dtype: native)
        assert uses_bfloat16(parse(["reference", "train-drafter"]), target) is native
        assert uses_bfloat16(parse(["reference", "train-drafter", "--compute-dtype", "bfloat16"]), target)
        assert not uses_bfloat16(parse(["reference", "train-drafter", "--compute-dtype", "float32"]), target)
