"""`anytime serve` on CUDA: vLLM's OpenAI server for an exported tiny model, started as a user starts it
(`anytime serve DIR --port P`, a process group of its own, stopped whole at the end), answers requests
that set `thinking_token_budget`: the thinking is cut after exactly the budget's tokens, the close text
and the answer header follow, then an answer of at most the protocol's length; the chat route returns
the answer apart from the thinking. The CPU twin (tests/serving/test_serve.py) compares every token with
`anytime eval`; only a GPU runs vLLM's CUDA sampler, its reasoning budget and our logits processor there."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import pytest

from tests.gpu.workloads import PROBES, require

pytestmark = pytest.mark.gpu

PROBE = PROBES["serve_at_budget"]
# eager: no CUDA graphs to capture for a handful of requests; a share of the GPU that leaves the rest free
FLAGS = ["--max-model-len", "512", "--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", "0.3",
         "--served-model-name", "tiny"]
REQUEST_TIMEOUT_S = 120


@pytest.fixture
def exported(tiny_model_dir, tmp_path) -> Path:
    """The tiny model as a run's checkpoint, exported as `anytime export` does it (its answer protocol
    beside it, from the run's recipe); first, the skip where vLLM is missing."""
    require(PROBE)
    from anytime.config import load_recipe
    from anytime.serving.export import export_checkpoint
    from tests.helpers import QUICKSTART
    from tests.serving.test_serve import RECIPE_OVERRIDES   # the CPU twin's budgets and answer length

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_1"
    shutil.copytree(tiny_model_dir, step)
    (step / "trainer_state.json").write_text("{}")   # what makes a run's checkpoint complete
    (run / "recipe.yaml").write_text(load_recipe(QUICKSTART, RECIPE_OVERRIDES).to_yaml())
    folder, diff = export_checkpoint(step, run / "export")
    assert diff <= 1e-5
    return folder


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


@pytest.mark.timeout(PROBE.limit_s)
def test_a_served_request_thinks_for_its_budget_then_answers(exported):
    from anytime.serving.serve import running_server

    log = exported.parent / "serve.log"
    try:   # the server's whole process group is stopped when the block ends, however it ends
        with running_server(exported, FLAGS, log, startup_s=PROBE.limit_s - 60) as url:
            seen = _completions_think_for_their_budget(url, exported)
            _chat_answers_apart_from_the_thinking(url, exported)
    except RuntimeError as exc:   # it did not start: its own words say why
        raise AssertionError(f"{exc}:\n{log.read_text()[-3000:]}") from None
    assert seen["cut"] > 0 and seen["answers"] > 0, seen


def _completions_think_for_their_budget(url: str, folder: Path) -> dict[str, int]:
    """Greedy completions of a few held-out prompts at every budget of the protocol: after exactly
    `budget` thinking tokens the close text (unless the model closed its thinking itself before), then
    the header, then an answer no longer than the protocol's. Counts what was seen."""
    from transformers import AutoTokenizer

    from anytime.data.benchmarks import load_benchmark
    from anytime.data.prompts import encode_prompts
    from anytime.config.answer_format import encode
    from anytime.serving.protocol import AnswerProtocol

    protocol = AnswerProtocol.read(folder)
    answer_format = protocol.format
    tokenizer = AutoTokenizer.from_pretrained(folder)
    end = encode(tokenizer, answer_format.think_end)
    close = encode(tokenizer, answer_format.close_phrase) + end   # forced at a cut: phrase, then vLLM's end marker
    header = encode(tokenizer, answer_format.header)
    prompts = encode_prompts(tokenizer, load_benchmark("synthetic", limit=3), protocol.instruction, 256)
    seen = {"cut": 0, "closed by itself": 0, "answers": 0}
    for i, prompt in enumerate(prompts):
        for budget in protocol.budgets:
            choice = _post(f"{url}/completions", {
                "model": "tiny", "prompt": prompt, "temperature": 0, "return_token_ids": True,
                "skip_special_tokens": False, "thinking_token_budget": protocol.request_budget(budget),
                "max_tokens": protocol.request_budget(budget) + answer_format.summary_max_tokens + 8})["choices"][0]
            ids = list(choice["token_ids"])
            ids = ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids
            where = f"problem {i} at budget {budget}: {ids}"
            closed = next((j for j in range(budget) if ids[j:j + len(end)] == end), None)
            if closed is None:   # the budget ran out: cut after exactly `budget` thinking tokens
                assert ids[budget:budget + len(close)] == close, f"not cut at the budget: {where}"
                answer_at = budget + len(close)
                seen["cut"] += 1
            else:                # the model closed its thinking itself: the header follows at once
                answer_at = closed + len(end)
                seen["closed by itself"] += 1
            assert ids[answer_at:answer_at + len(header)] == header, f"no answer header: {where}"
            answer = ids[answer_at + len(header):]
            assert len(answer) <= answer_format.summary_max_tokens, f"answer too long: {where}"
            seen["answers"] += bool(answer)
    return seen


def _chat_answers_apart_from_the_thinking(url: str, folder: Path) -> None:
    """The chat route returns the thinking as `reasoning` and the answer, header first, as `content` (the
    reasoning parser reads the end marker in the text, so a tokenizer that marks it special needs
    skip_special_tokens off)."""
    from anytime.serving.protocol import AnswerProtocol

    protocol = AnswerProtocol.read(folder)
    message = _post(f"{url}/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Start with 3. Add 4, add 5."}],
        "temperature": 0, "max_tokens": 64, "skip_special_tokens": False,
        "thinking_token_budget": protocol.request_budget(protocol.budgets[0])})["choices"][0]["message"]
    assert (message.get("content") or "").startswith(protocol.format.header), message
    assert message.get("reasoning") or message.get("reasoning_content"), message
