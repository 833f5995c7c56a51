"""Tiny random-initialised chat models for CPU tests, quickstarts and benchmarks.

A tiny model is a real Hugging Face checkpoint (config, safetensors weights, a byte-level BPE
tokenizer trained on a caller-supplied corpus, a Qwen-style chat template, a generation config)
written with ``save_pretrained``, so every consumer goes through the ordinary ``from_pretrained``
path that a full-size model uses. Head dim defaults to 64 because vLLM's CPU attention kernels
serve only a fixed set of head sizes (see ``anytime.rollout.engines.vllm``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

# The special tokens every anytime model needs as single ids; <|endoftext|> doubles as padding.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")

# Qwen-style chat template; the generation prompt opens the thinking block, as the
# anytime rollout expects thinking to start right after the prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)

_ARCHS = ("qwen2", "llama")


def _train_tokenizer(corpus: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer (every byte representable, so no unknown tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    out_dir: str | Path,
    corpus: Iterable[str],
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    intermediate_size: int | None = None,
    seed: int = 0,
) -> Path:
    """Write a random-initialised causal LM + trained tokenizer to ``out_dir`` and return the path.

    ``vocab_size`` is the model's embedding size and the tokenizer's target size; a small corpus may
    yield fewer BPE tokens, in which case the extra embedding rows are simply never produced by the
    tokenizer. Weights depend only on the arguments (``seed``), not on global RNG state.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    if arch not in _ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; use one of {_ARCHS}")
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {min_vocab}")

    texts = list(corpus)
    if not any(t.strip() for t in texts):
        raise ValueError("corpus is empty: pass some text to train the tokenizer on")
    tokenizer = _train_tokenizer(texts, vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}

    config_cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    # fork_rng keeps the caller's global RNG untouched while making the weights reproducible.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
