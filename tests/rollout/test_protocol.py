"""The answer protocol an export carries (`anytime.rollout.protocol`): what vLLM's budget counts, measured
on the tokenizer, and a protocol file that is refused clearly when it is not one."""

import pytest
from transformers import AutoTokenizer

from anytime.models.tiny import CHAT_TEMPLATE
from anytime.rollout.protocol import PROTOCOL_FILE, AnswerProtocol

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_budget_vllm_counts_includes_the_newline_after_think_and_the_close_phrase(tokenizer):
    protocol = AnswerProtocol(budgets=[16]).measured(tokenizer)
    assert protocol.think_start == "<think>"
    assert protocol.start_tokens_in_prompt == len(tokenizer.encode("\n", add_special_tokens=False))
    assert protocol.close_phrase == "...\n\n...\n\n"
    assert protocol.close_phrase_tokens == len(tokenizer.encode(protocol.close_phrase, add_special_tokens=False))
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


def test_a_close_text_that_does_not_end_with_the_marker_is_refused(tokenizer):
    with pytest.raises(ValueError, match="does not end with the end marker"):
        AnswerProtocol(close_text="... so:").measured(tokenizer)


def test_the_protocol_file_round_trips_and_a_wrong_one_says_what_to_do(tmp_path):
    protocol = AnswerProtocol(budgets=[8, 16], summary_max_tokens=8, start_tokens_in_prompt=2)
    protocol.write(tmp_path)
    assert AnswerProtocol.read(tmp_path) == protocol
    assert AnswerProtocol.read(tmp_path / "none") is None
    (tmp_path / PROTOCOL_FILE).write_text('{"budgetz": [1]}')
    with pytest.raises(ValueError, match="unknown keys.*re-export the model"):
        AnswerProtocol.read(tmp_path)


def test_the_model_card_table_reads_accuracy_per_budget_before_and_after_rl():
    from anytime.learner.model_card import accuracy_table

    table = accuracy_table({"before": {"eval/synthetic/acc@16": 0.1, "eval/synthetic/cut@16": 1.0},
                            "after": {"eval/synthetic/acc@16": 0.5, "eval/synthetic/acc@32": 0.75}})
    assert "| synthetic | 16 | 0.100 | 0.500 |" in table and "| synthetic | 32 | — | 0.750 |" in table
    assert "cut" not in table and accuracy_table({}) == ""
