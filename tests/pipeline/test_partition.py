"""Stage partitioning of HF causal LMs: chaining the stages reproduces the full model."""

from __future__ import annotations

import os

import pytest
import torch

from anytime.pipeline.partition import (
    StageLayout,
    balanced_layer_split,
    build_stages,
    load_causal_lm,
    tied_embeddings,
)

pytestmark = pytest.mark.unit

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _qwen2(**kw):
    import transformers

    base = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 5, "num_attention_heads": 2,
                "num_key_value_heads": 1, "vocab_size": 50, "max_position_embeddings": 32}
    return transformers.Qwen2Config(**{**base, **kw})


def _llama(**kw):
    import transformers

    base = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 50, "max_position_embeddings": 32}
    return transformers.LlamaConfig(**{**base, **kw})


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0
    return ids, mask


@pytest.mark.parametrize("layers,stages,want", [(8, 4, [2, 2, 2, 2]), (10, 4, [2, 3, 3, 2]),
                                                (5, 4, [1, 2, 1, 1]), (3, 2, [2, 1]), (4, 1, [4])])
def test_balanced_split_gives_extra_layers_to_middle_stages(layers, stages, want):
    assert balanced_layer_split(layers, stages) == want


def test_layout_rejects_counts_that_do_not_cover_the_model():
    with pytest.raises(ValueError, match="summing to"):
        StageLayout.build(4, 2, [1, 2])
    with pytest.raises(ValueError, match="num_stages"):
        balanced_layer_split(4, 0)


@pytest.mark.parametrize("make,stages,tied", [(_qwen2, 3, False), (_qwen2, 4, True), (_llama, 2, False),
                                              (_llama, 4, True)])
def test_chained_stages_reproduce_the_full_model(make, stages, tied):
    model = load_causal_lm(make(tie_word_embeddings=tied), dtype=torch.float64, seed=3)
    assert tied_embeddings(model) == tied
    ids, mask = _inputs()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    parts = build_stages(model, range(stages), stages)
    x = ids
    with torch.no_grad():
        for s in range(stages):
            x = parts[s](x, attention_mask=mask)
    torch.testing.assert_close(x, want, rtol=0, atol=1e-12)
    assert parts[0].is_first and parts[stages - 1].is_last and parts[0].embed_tokens is not None
    assert (parts[0].embed_tokens.weight is parts[stages - 1].lm_head.weight) == tied
    # Local names map back onto the full state dict, each key held by exactly one stage.
    names = [parts[s].original_name(n) for s in range(stages) for n, _ in parts[s].named_parameters()]
    assert len(names) == len(set(names))
    assert set(names) == set(model.state_dict())


def test_sliding_window_layers_get_their_own_mask():
    config = _qwen2(use_sliding_window=True, sliding_window=3, max_window_layers=2, num_hidden_layers=4)
    model = load_causal_lm(config, dtype=torch.float64, seed=1)
    assert "sliding_attention" in config.layer_types
    ids, mask = _inputs()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        parts = build_stages(model, [0, 1], 2)
        got = parts[1](parts[0](ids, attention_mask=mask), attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_unsupported_architecture_is_a_clear_error():
    import transformers

    config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=30, n_positions=16)
    with pytest.raises(ValueError, match="cannot partition model type 'gpt2'"):
        load_causal_lm(config)
    with pytest.raises(TypeError, match="PretrainedConfig"):
        load_causal_lm(12)


def test_stages_from_a_saved_checkpoint_match_the_saved_model(tmp_path):
    model = load_causal_lm(_llama(), dtype=torch.float32, seed=5)
    model.save_pretrained(tmp_path)
    loaded = load_causal_lm(str(tmp_path), dtype=torch.float64)
    ids, mask = _inputs()
    with torch.no_grad():
        want = model.double()(input_ids=ids, attention_mask=mask).logits
        parts = build_stages(loaded, [0, 1], 2)
        got = parts[1](parts[0](ids, attention_mask=mask), attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
