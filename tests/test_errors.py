"""Each bad input gets one clear error naming the problem and the fix."""

import types

import pytest
import torch

from treeflash_hf import TreeFlashInputError, TreeOptions, reference, treeflash_generate
from treeflash_hf.integrations.generate_hook import tree_attention_backend
from treeflash_hf.recipes.testing import matching_drafter, random_target
from treeflash_hf.engine.validation import check_attention_backend

PROMPT = torch.tensor([[1, 2, 3, 4]])


@pytest.fixture(scope="module")
def target():
    return random_target("qwen3", seed=0)


def test_drafter_for_a_deeper_target(target):
    deeper = random_target("qwen3", num_layers=12, seed=0)
    drafter = matching_drafter(deeper, num_layers=3)
    with pytest.raises(TreeFlashInputError, match="reads target layers .* trained for another target"):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4)


def test_drafter_for_a_target_with_other_depth(target):
    drafter = matching_drafter(random_target("qwen3", num_layers=6, seed=0), num_layers=2)
    drafter.config.target_layer_ids = [0, 3]
    with pytest.raises(TreeFlashInputError, match="6 layers, this target has 4"):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4)


def test_hidden_size_mismatch(target):
    drafter = matching_drafter(random_target("qwen3", hidden_size=32, num_heads=2, num_kv_heads=1, seed=0))
    with pytest.raises(TreeFlashInputError, match="hidden_size 32 != target hidden_size 64"):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4)


def test_vocabulary_mismatch(target):
    drafter = matching_drafter(random_target("qwen3", vocab_size=300, seed=0))
    with pytest.raises(TreeFlashInputError, match="vocab_size 300 .* share one tokenizer"):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4)


@pytest.mark.parametrize(
    "option,value,message",
    [("tree_budget", 0, "tree_budget=0 is invalid"), ("tree_top_m", 0, "tree_top_m=0 is invalid"),
     ("tree_top_k", -1, "tree_top_k=-1 is invalid"), ("tree_mode", "beam", "not a TreeFlash mode"),
     ("tree_budget", 2.5, "tree_budget=2.5 is invalid")],
)
def test_bad_knobs(target, option, value, message):
    drafter = matching_drafter(target)
    with pytest.raises(ValueError, match=message):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4, **{option: value})
    with pytest.raises(ValueError, match=message):
        TreeOptions(**{option: value})


def test_batch_without_a_pad_token(target):
    drafter = matching_drafter(target)
    target.generation_config.pad_token_id = None
    with pytest.raises(TreeFlashInputError, match="needs a pad token.*pad_token_id="):
        target.generate(torch.cat([PROMPT, PROMPT]), assistant_model=drafter, max_new_tokens=4)


def test_right_padding(target):
    drafter = matching_drafter(target)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(TreeFlashInputError, match="right-padded.*padding_side='left'"):
        target.generate(torch.cat([PROMPT, PROMPT]), attention_mask=mask, assistant_model=drafter,
                        max_new_tokens=4, pad_token_id=0)


def test_rows_longer_than_the_target_allows(target):
    drafter = matching_drafter(target)
    long_prompt = torch.ones(2, 4090, dtype=torch.long)
    with pytest.raises(TreeFlashInputError, match="need 4100 positions but the target holds at most 4096"):
        target.generate(long_prompt, assistant_model=drafter, max_new_tokens=10, pad_token_id=0)


def test_empty_prompt(target):
    drafter = matching_drafter(target)
    with pytest.raises(TreeFlashInputError, match="A prompt is empty"):
        target.generate(torch.ones(1, 0, dtype=torch.long), assistant_model=drafter, max_new_tokens=4)
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    with pytest.raises(TreeFlashInputError, match="A prompt is empty"):
        target.generate(torch.cat([PROMPT, PROMPT]), attention_mask=mask, assistant_model=drafter,
                        max_new_tokens=4, pad_token_id=0)


def test_beam_search(target):
    drafter = matching_drafter(target)
    with pytest.raises(TreeFlashInputError, match="Beam search \\(num_beams=2\\).*num_beams=1"):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4, num_beams=2)


def test_streamer_with_a_batch(target):
    from transformers import AutoTokenizer, TextStreamer
    from transformers.generation.streamers import BaseStreamer

    class Quiet(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    drafter = matching_drafter(target)
    batch = torch.cat([PROMPT, PROMPT])
    with pytest.raises(ValueError, match="Quiet only supports batch size 1"):
        target.generate(batch, assistant_model=drafter, max_new_tokens=4, pad_token_id=0, streamer=Quiet())
    # transformers' own streamer: the very error plain generate() gives
    tokenizer = AutoTokenizer.from_pretrained(reference.BUNDLED_DIR / "tokenizer")
    with pytest.raises(ValueError, match="TextStreamer only supports batch size 1"):
        target.generate(batch, max_new_tokens=4, pad_token_id=0, streamer=TextStreamer(tokenizer))
    with pytest.raises(ValueError, match="TextStreamer only supports batch size 1"):
        target.generate(batch, assistant_model=drafter, max_new_tokens=4, pad_token_id=0,
                        streamer=TextStreamer(tokenizer))


def test_inputs_on_another_device(target):
    drafter = matching_drafter(target)
    with pytest.raises(TreeFlashInputError, match="input_ids are on meta .* move the inputs"):
        treeflash_generate(target, drafter, PROMPT.to("meta"), max_new_tokens=4)


def test_drafter_on_another_dtype(target):
    drafter = matching_drafter(target).to(torch.bfloat16)
    with pytest.raises(TreeFlashInputError, match="dtype torch.bfloat16 != target dtype torch.float32"):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4)


def test_attention_backend_without_tree_masks():
    fake = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(TreeFlashInputError, match="cannot take a tree attention mask.*attn_implementation='sdpa'"):
        check_attention_backend(fake)


def test_flash_attention_target_is_switched_to_sdpa_for_the_call():
    switched = []
    config = types.SimpleNamespace(_attn_implementation="flash_attention_2")

    def set_attn_implementation(name):
        switched.append(name)
        config._attn_implementation = name

    fake = types.SimpleNamespace(config=config, set_attn_implementation=set_attn_implementation)
    with tree_attention_backend(fake):
        assert config._attn_implementation == "sdpa"
    assert switched == ["sdpa", "flash_attention_2"]

    def refuse(name):
        raise ValueError("no sdpa")

    stuck = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"),
                                  set_attn_implementation=refuse)
    with pytest.raises(TreeFlashInputError, match="cannot switch to 'sdpa'"):
        with tree_attention_backend(stuck):
            pass
