"""The tiny model builder writes a real, reloadable checkpoint with the tokens anytime relies on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from anytime.models.tiny import SPECIAL_TOKENS, build_tiny_model

pytestmark = pytest.mark.unit

CORPUS = [
    f"Q: {a} times {b}? <think>\n{a}*{b}={a * b}\n</think>\n\\boxed{{{a * b}}}" for a in range(25) for b in range(25)
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen"), CORPUS, seed=3)


def test_checkpoint_files_and_config(qwen_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (qwen_dir / name).is_file(), name
    config = AutoConfig.from_pretrained(qwen_dir)
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        128,
        2,
        2,
        1,
    )
    assert config.head_dim == 64
    assert config.vocab_size == 512
    gen = json.loads((qwen_dir / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>") == config.eos_token_id


def test_special_tokens_are_single_ids(qwen_dir):
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    ids = [tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(SPECIAL_TOKENS)
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert len(tok) <= 512
    # Special tokens survive inside running text as single ids too.
    enc = tok.encode("so 6</think>\n\nanswer", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("</think>") in enc


def test_chat_template_opens_thinking(qwen_dir):
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[-2] == tok.convert_tokens_to_ids("<think>")
    assert tok.decode(ids) == text


def test_byte_level_roundtrip_any_text(qwen_dir):
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    text = "Unseen ✓ naïve 東京 \t tabs  and \\frac{1}{2}\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_reload_is_bit_identical_and_seeded(qwen_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(qwen_dir)
    again = build_tiny_model(tmp_path / "same", CORPUS, seed=3)
    other = build_tiny_model(tmp_path / "other", CORPUS, seed=4)
    sd, sd_again = model.state_dict(), AutoModelForCausalLM.from_pretrained(again).state_dict()
    sd_other = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert all(torch.equal(sd[k], sd_again[k]) for k in sd)
    assert not torch.equal(sd["model.embed_tokens.weight"], sd_other["model.embed_tokens.weight"])


def test_builder_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path, CORPUS[:50])
    assert torch.equal(torch.rand(3), expected)


def test_llama_arch(tmp_path):
    path = build_tiny_model(tmp_path, CORPUS[:100], arch="llama", hidden_size=256, num_heads=4, num_kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.head_dim == 64 and model.config.num_key_value_heads == 2
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 512) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"arch": "gpt2"}, "arch"),
        ({"hidden_size": 130, "num_heads": 4}, "divisible by num_heads"),
        ({"num_heads": 2, "num_kv_heads": 3}, "num_kv_heads"),
        ({"vocab_size": 100}, "vocab_size"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_tiny_model(tmp_path, CORPUS[:10], **kwargs)


def test_empty_corpus(tmp_path):
    with pytest.raises(ValueError, match="corpus is empty"):
        build_tiny_model(tmp_path, ["", "  "])


def test_the_recipe_sizes_the_tiny_model(tmp_path):
    """`model.tiny_*` reach the builder, key/value heads included (the quickstart uses full attention)."""
    from anytime.config import load_recipe
    from anytime.trainer.launch import prepare_model

    quickstart = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    recipe = load_recipe(quickstart, [f"model.path={tmp_path / 'init'}", "sft.steps=0",
                                      "model.tiny_layers=1", "model.tiny_kv_heads=1"])
    config = AutoConfig.from_pretrained(prepare_model(recipe))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        64, 1, 2, 1)
    assert load_recipe(quickstart).model.tiny_kv_heads == 2
