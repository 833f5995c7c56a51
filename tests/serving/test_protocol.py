"""The answer protocol an export carries (`anytime.serving.protocol`): what vLLM's budget counts, measured
on the tokenizer, and a protocol file that is refused clearly when it is not one."""

import json

import pytest
from transformers import AutoTokenizer

from anytime.config.answer_format import AnswerFormat
from anytime.errors import RecipeError
from anytime.models.tiny import CHAT_TEMPLATE
from anytime.serving.protocol import PROTOCOL_FILE, AnswerProtocol

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_budget_vllm_counts_includes_the_newline_after_think_and_the_close_phrase(tokenizer):
    protocol = AnswerProtocol(budgets=[16]).measured(tokenizer)
    assert protocol.think_start == "<think>"
    assert protocol.start_tokens_in_prompt == len(tokenizer.encode("\n", add_special_tokens=False))
    assert protocol.format.close_phrase == "...\n\n...\n\n"
    assert protocol.close_phrase_tokens == len(tokenizer.encode(protocol.format.close_phrase, add_special_tokens=False))
    assert protocol.request_budget(16) == 16 + protocol.start_tokens_in_prompt + protocol.close_phrase_tokens
    assert protocol.reasoning_config() == {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}


def test_a_template_without_think_counts_from_its_last_special_token(tokenizer):
    plain = CHAT_TEMPLATE.replace("<think>\\n", "")
    assert plain != CHAT_TEMPLATE
    saved, tokenizer.chat_template = tokenizer.chat_template, plain
    try:
        protocol = AnswerProtocol().measured(tokenizer)
    finally:
        tokenizer.chat_template = saved
    assert protocol.think_start == "<|im_start|>"
    assert protocol.start_tokens_in_prompt == len(tokenizer.encode("assistant\n", add_special_tokens=False))


def test_an_end_marker_that_merges_with_the_close_text_is_refused_when_measured(tokenizer):
    """`measured` runs the format's tokenisation rule (`AnswerFormat.check_tokenisation`)."""
    merging = AnswerFormat(think_end="Answer", close_text="... Answer")   # " Answer" is one token of its own here
    with pytest.raises(RecipeError, match="merges with the text around it"):
        AnswerProtocol(merging).measured(tokenizer)


def test_the_protocol_file_round_trips_and_a_wrong_one_says_what_to_do(tmp_path):
    protocol = AnswerProtocol(AnswerFormat(summary_max_tokens=8), budgets=[8, 16], start_tokens_in_prompt=2)
    protocol.write(tmp_path)
    assert AnswerProtocol.read(tmp_path) == protocol
    assert AnswerProtocol.read(tmp_path / "none") is None
    (tmp_path / PROTOCOL_FILE).write_text('{"budgetz": [1]}')
    with pytest.raises(ValueError, match="unknown keys.*re-export the model"):
        AnswerProtocol.read(tmp_path)


# A file as `anytime export` wrote it before the answer format was one value: the format's keys flat
# beside the protocol's own (the file keeps that layout).
OLD_PROTOCOL_FILE = r"""{
  "think_start": "<think>",
  "think_end": "</think>",
  "close_text": "...\n\n...\n\n</think>",
  "header": "\n\n**Final Answer**\n",
  "summary_max_tokens": 8,
  "budgets": [4, 8],
  "temperature": 0.6,
  "top_p": 0.95,
  "eos_ends_thinking": true,
  "instruction": "Let's think step by step and output the final answer within \\boxed{}.",
  "start_tokens_in_prompt": 1,
  "close_phrase_tokens": 3
}
"""


def test_a_protocol_file_of_an_earlier_version_still_loads_and_is_written_alike(tmp_path):
    (tmp_path / PROTOCOL_FILE).write_text(OLD_PROTOCOL_FILE)
    protocol = AnswerProtocol.read(tmp_path)
    assert protocol.format == AnswerFormat(summary_max_tokens=8, eos_ends_thinking=True)
    assert (protocol.budgets, protocol.start_tokens_in_prompt, protocol.close_phrase_tokens) == ([4, 8], 1, 3)
    assert json.loads(protocol.to_json()) == json.loads(OLD_PROTOCOL_FILE)   # the same flat keys, as before


def test_the_model_card_table_reads_accuracy_per_budget_before_and_after_rl():
    from anytime.serving.model_card import accuracy_table

    table = accuracy_table({"before": {"eval/synthetic/acc@16": 0.1, "eval/synthetic/cut@16": 1.0},
                            "after": {"eval/synthetic/acc@16": 0.5, "eval/synthetic/acc@32": 0.75}})
    assert "| synthetic | 16 | 0.100 | 0.500 |" in table and "| synthetic | 32 | — | 0.750 |" in table
    assert "cut" not in table and accuracy_table({}) == ""
