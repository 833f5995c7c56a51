"""Tests for the verifiable math reward: extraction, gold normalisation, verdicts, the worker pool."""

from __future__ import annotations

import importlib.util
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from anytime.reward.answer import MAX_ANSWER_CHARS, as_latex, strip_math_delimiters
from anytime.reward.verifier import (
    REASONS,
    THINK_END,
    RewardScorer,
    Verdict,
    extract_answer,
    extract_boxed,
    normalize_gold,
    score_one,
)
from tests.helpers import kill_and_clean

REPO_ROOT = Path(__file__).resolve().parents[2]


def answer(content: str) -> str:
    """What the caller passes for a model that closed its thinking and boxed ``content``."""
    return f"\n\nlast thoughts\n\n{THINK_END}\n\n**Final Answer**\n\\boxed{{{content}}}"


def gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids)


# ----------------------------------------------------------------------------- extraction


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{42}", "42"),
        (r"so \boxed{\frac{1}{2}} done", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{\frac{a^{2}}{b_{1}}}}", r"\sqrt{\frac{a^{2}}{b_{1}}}"),
        (r"\boxed{1} then \boxed{2}", "2"),  # last box wins
        (r"\boxed{1} then \boxed{2", "1"),  # an unclosed last box does not count
        (r"\boxed{\boxed{3}}", r"\boxed{3}"),  # the box that closes last
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces are not grouping
        (r"\boxed{ 7 }", "7"),
        (r"\boxed {7}", "7"),
        (r"\boxed 5", "5"),
        (r"\fbox{8}", "8"),
        (r"\boxed{}", ""),
        ("no box here", None),
        (r"\boxedx{3}", None),
        ("}}}" + r"\boxed{4}" + "{{{", "4"),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.unit
def test_extract_boxed_caps_content_and_is_linear() -> None:
    assert extract_boxed(r"\boxed{" + "1" * MAX_ANSWER_CHARS + "}") == "1" * MAX_ANSWER_CHARS
    assert extract_boxed(r"\boxed{" + "1" * (MAX_ANSWER_CHARS + 1) + "}") is None
    start = time.perf_counter()
    assert extract_boxed(r"\boxed{" + "{" * 10_000 + "}" * 10_000 + "}") is None
    assert extract_boxed("{" * 1_000_000) is None
    assert extract_boxed(r"\boxed{1}" * 1000) == "1"
    assert time.perf_counter() - start < 2.0  # generous; a quadratic scan takes minutes


@pytest.mark.unit
def test_extract_answer_header_paragraph_rule() -> None:
    text = "intro \\boxed{1}\n\n**Final Answer**\nso \\boxed{2} and \\boxed{3}\n\n\\boxed{4}"
    assert extract_answer(text) == "3"  # last box of the header paragraph, not of the text
    # The first header paragraph wins, even without a box.
    assert extract_answer("**Final Answer**\nnone\n\n**Final Answer** \\boxed{5}") is None
    # A box after a blank line following the header is outside the header paragraph.
    assert extract_answer("**Final Answer**\n\n\\boxed{6}") is None
    assert extract_answer("no header \\boxed{7}") is None
    # Surrounding whitespace of the header (the forced text) and the paragraph is ignored.
    assert extract_answer("  **Final Answer**\n\\boxed{8}", header="\n\n**Final Answer**\n") == "8"
    assert extract_answer("Answer: \\boxed{9}", header="Answer:") == "9"
    # A header that opens the box: the model's text closes it.
    boxed_header = "\n\n**Final Answer**\n\\boxed{"
    assert extract_answer("**Final Answer**\n\\boxed{10} wait \\boxed{11}", header=boxed_header) == "11"
    assert extract_answer("**Final Answer**\n\\boxed{12", header=boxed_header) is None   # never closed
    assert extract_answer("**Final Answer**\n\\boxed{\\frac{1}{2}}", header=boxed_header) == "\\frac{1}{2}"
    with pytest.raises(ValueError, match="header"):
        extract_answer("x", header=" \n")


# ----------------------------------------------------------------------------- gold normalisation


@pytest.mark.unit
def test_normalize_gold() -> None:
    assert normalize_gold(142.0) == ["142"]
    assert normalize_gold(0.5) == ["0.5"]
    assert normalize_gold(-3) == ["-3"]
    assert normalize_gold("025") == ["025"]
    assert normalize_gold(["35.06\n", "35.1"]) == ["35.06", "35.1"]
    assert normalize_gold(r"  \frac{1}{2} ") == [r"\frac{1}{2}"]
    assert normalize_gold(["$69$,$84$"]) == ["69,84"]
    assert normalize_gold(r"$(-\infty, 0) \cup\{1\}$.") == [r"(-\infty, 0) \cup\{1\}"]
    assert normalize_gold(r"\$18.90") == [r"\$18.90"]  # a currency sign is not a delimiter
    assert strip_math_delimiters("$x=2$") == "x=2"
    assert as_latex("(x+1)^2") == "$(x+1)^2$"
    assert as_latex("$3.89e-10$") == r"$3.89 \times 10^{-10}$"
    assert as_latex("e^{2}") == "$e^{2}$"
    for bad in (None, "", " \n", [], [""], True, math.nan, math.inf, {"a": 1}, [[1]]):
        with pytest.raises(ValueError):
            normalize_gold(bad)


# ----------------------------------------------------------------------------- verdicts


@pytest.mark.unit
@pytest.mark.parametrize(
    ("content", "gold", "score"),
    [
        ("142", 142.0, 1.0),
        ("142.0", 142.0, 1.0),
        ("25", "025", 1.0),
        (r"\dfrac{1}{2}", r"\frac{1}{2}", 1.0),
        ("0.5", r"\frac{1}{2}", 1.0),
        ("x^2+2x+1", "(x+1)^2", 1.0),
        ("(x+1)^{2}", "(x+1)^2", 1.0),
        ("x^2+1", "(x+1)^2", 0.0),
        ("[1,2)", "[1,2)", 1.0),
        ("(1,2]", "[1,2)", 0.0),
        (r"\left[ 1, 2 \right)", "[1,2)", 1.0),
        ("84, 69", ["$69$,$84$"], 1.0),
        ("3.3e12", ["3.3e12\n"], 1.0),
        (r"3.3 \times 10^{12}", ["3.3e12\n"], 1.0),  # E notation is not Euler's e
        ("3300000000000", ["3.3e12\n"], 1.0),
        ("3.4e12", ["3.3e12\n"], 0.0),
        ("3.89e-10", ["3.89e-10"], 1.0),
        ("$5$", 5, 1.0),
        (r"\frac{e^{t}}{3}+ce^{-2t}", ["x = \\frac{e^{t}}{3} + ce^{-2t}\n", "\\frac{e^{t}}{3} + c e^{-2t}\n"], 1.0),
        ("43", 42, 0.0),
    ],
)
def test_score_one_verdicts(content: str, gold: object, score: float) -> None:
    verdict = score_one(answer(content), gold)
    assert verdict.score == score
    assert verdict.reason == ("correct" if score else "wrong")
    assert verdict.parsed == content


@pytest.mark.unit
def test_score_one_format_and_missing_answers() -> None:
    assert score_one("**Final Answer**\n\\boxed{1}", 1) == Verdict(0.0, "bad_format", None)
    two = f"{THINK_END}{THINK_END}\n\n**Final Answer**\n\\boxed{{1}}"
    assert score_one(two, 1).reason == "bad_format"
    assert score_one(f"{THINK_END}\n\nthe answer is \\boxed{{1}}", 1) == Verdict(0.0, "no_answer", None)
    assert score_one(f"{THINK_END}\n\n**Final Answer**\n\\boxed{{}}", 1).reason == "no_answer"
    # A header paragraph inside the thinking does not count: only text after the marker does.
    early = f"**Final Answer**\n\\boxed{{1}}\n\n{THINK_END}\n\nnothing"
    assert score_one(early, 1).reason == "no_answer"
    custom = "<|end_think|>\n\nAnswer: \\boxed{7}"
    assert score_one(custom, 7, header="Answer:", think_end="<|end_think|>").reason == "correct"
    assert score_one(answer("7"), 7, think_end="<|end_think|>").reason == "bad_format"
    assert set(REASONS) == {"correct", "wrong", "no_answer", "bad_format", "timeout", "error"}


@pytest.mark.unit
def test_score_one_sanitizes_untrusted_text() -> None:
    assert score_one(answer("4\x002"), 42).reason == "correct"
    verdict = score_one(answer("\ud800 7"), 7)  # lone surrogate: replaced, not a crash
    assert verdict.reason in {"correct", "wrong"} and "\ud800" not in verdict.parsed
    with pytest.raises(ValueError, match="str"):
        score_one(b"bytes", 1)  # type: ignore[arg-type]


@pytest.mark.unit
def test_score_one_refuses_threads_with_alarm_timeouts() -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            score_one(answer("1"), 1)
        except RuntimeError as err:
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


# ----------------------------------------------------------------------------- the worker pool


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(num_workers=2, timeout_s=10.0) as pool:
        yield pool


@pytest.mark.integration
def test_scorer_matches_score_one_in_order(scorer: RewardScorer) -> None:
    golds = list(range(300))
    texts = [answer(str(g if g % 3 else g + 1)) for g in golds]
    texts[5] = "no marker"
    texts[7] = f"{THINK_END}\n\nno header"
    verdicts = scorer.score(texts, golds)
    assert [v.score for v in verdicts] == [0.0 if g % 3 == 0 or g in (5, 7) else 1.0 for g in golds]
    assert verdicts[5].reason == "bad_format" and verdicts[7].reason == "no_answer"
    assert verdicts[3] == Verdict(0.0, "wrong", "4")
    for i in (0, 1, 5, 7, 8):
        assert verdicts[i] == score_one(texts[i], golds[i])
    assert scorer.score([], []) == []


@pytest.mark.integration
def test_scorer_rejects_bad_input(scorer: RewardScorer) -> None:
    with pytest.raises(ValueError, match="2 texts but 1 golds"):
        scorer.score(["a", "b"], [1])
    with pytest.raises(ValueError, match=r"golds\[1\]"):
        scorer.score([answer("1"), answer("2")], [1, None])
    with pytest.raises(ValueError, match=r"texts\[0\]"):
        scorer.score([None], [1])  # type: ignore[list-item]
    assert scorer.score([answer("2")], [2])[0].score == 1.0  # still usable
    for kwargs in ({"num_workers": 0}, {"timeout_s": 0}, {"chunk_size": 0}, {"header": ""}):
        with pytest.raises(ValueError):
            RewardScorer(**kwargs)


@pytest.mark.integration
def test_scorer_replaces_a_worker_that_died_while_idle(scorer: RewardScorer) -> None:
    victim = scorer.pids[0]
    os.kill(victim, signal.SIGKILL)
    assert [v.score for v in scorer.score([answer("1"), answer("2")], [1, 3])] == [1.0, 0.0]
    assert victim not in scorer.pids and len(scorer.pids) == 2


@pytest.mark.integration
def test_adversarial_outputs_score_zero_without_leaks() -> None:
    header = f"{THINK_END}\n\n**Final Answer**\n"
    adversarial = {
        "nested_braces": header + r"\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
        "tower": answer("9^{9^{9^{9^{9}}}}"),
        "one_megabyte": header + r"\boxed{" + "9" * 1_000_000 + "}",
        "one_megabyte_text": "x" * 1_000_000 + answer("41"),
        "nul_bytes": answer("\x00" * 1000 + "41"),
        "surrogates": answer("\ud800\udfff" * 100 + "\ud800"),
        "unbalanced": header + r"\boxed{42" + "{" * 500,
        "stray_closers": header + "}" * 5000 + r"\boxed{41}}}}",
        "thousand_boxes": header + r"\boxed{}" * 1000,
        "thousand_boxes_full": header + r"\boxed{\frac{1}{2}}" * 1000,
        "deep_parens": answer("(" * 2000 + "1" + ")" * 2000),
        "huge_power": answer("10^{10^{10}}"),
    }
    timeout_s = 3.0
    with RewardScorer(num_workers=2, timeout_s=timeout_s) as pool:
        pids = pool.pids
        start = time.monotonic()
        verdicts = pool.score(list(adversarial.values()), [42] * len(adversarial))
        elapsed = time.monotonic() - start
        for name, verdict in zip(adversarial, verdicts):
            assert verdict.score == 0.0, (name, verdict.reason)
            assert verdict.reason in REASONS, name
        # Every item is bounded by its own limit; two workers share the list.
        assert elapsed < timeout_s * len(adversarial), elapsed
        assert pool.score([answer("42")], [42])[0].reason == "correct"
        pids += pool.pids
    assert gone(pids)
    assert not [p for p in mp.active_children() if p.pid in pids]


@pytest.mark.integration
def test_an_item_that_overruns_is_killed_and_the_scorer_keeps_working() -> None:
    with RewardScorer(num_workers=1, timeout_s=0.5) as pool:
        first = pool.pids[0]
        verdicts = pool.score([answer("1"), answer("9^{9^{9}}"), answer("3")], [1, 42, 3])
        assert verdicts[1] == Verdict(0.0, "timeout", None)
        # The items around it were scored (the one after it by the replacement worker).
        assert [verdicts[0].reason, verdicts[2].reason] == ["correct", "correct"]
        assert pool.pids[0] != first and gone([first])
        assert pool.score([answer("5")], [5])[0].reason == "correct"
        pids = pool.pids
    assert gone(pids)


@pytest.mark.integration
def test_an_item_starved_of_cpu_by_a_busy_machine_does_not_time_out() -> None:
    """The limit counts the worker's CPU time: a worker that gets no CPU for longer than the limit
    (here: stopped, as a loaded machine would starve it) still finishes its item with a verdict."""
    with RewardScorer(num_workers=1, timeout_s=0.5) as pool:
        pool.wait_ready()
        (pid,) = pool.pids
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(1.5, os.kill, (pid, signal.SIGCONT)).start()
        start = time.monotonic()
        verdicts = pool.score(["</think>\n\n**Final Answer**\n\\boxed{42}"], ["42"])
        assert time.monotonic() - start >= 1.4  # it waited for the stopped worker, past 0.5 s of wall time
        assert [v.reason for v in verdicts] == ["correct"]
        assert pool.pids == [pid]  # not killed


@pytest.mark.integration
def test_an_item_whose_worker_dies_twice_is_an_error() -> None:
    """A worker killed from outside mid-item (as the OOM killer would): one retry, then "error"."""

    def kill_when_busy(pool: RewardScorer, kills: list[int]) -> None:
        deadline = time.monotonic() + 60
        while len(kills) < 2 and time.monotonic() < deadline:
            pid = pool.pids[0]
            try:
                # Busy on the endless item: far more CPU than the start-up warm-up uses.
                if pid not in kills and psutil.Process(pid).cpu_times().user > 1.0:
                    os.kill(pid, signal.SIGKILL)
                    kills.append(pid)
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.05)

    with RewardScorer(num_workers=1, timeout_s=120.0) as pool:
        kills: list[int] = []
        killer = threading.Thread(target=kill_when_busy, args=(pool, kills))
        killer.start()
        verdicts = pool.score([answer("9^{9^{9}}"), answer("2")], [42, 2])
        killer.join()
        assert len(kills) == 2
        assert verdicts == [Verdict(0.0, "error", None), Verdict(1.0, "correct", "2")]
        pids = pool.pids
    assert gone(pids + kills)


ORPHAN_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from anytime.reward.verifier import RewardScorer
if __name__ == "__main__":
    scorer = RewardScorer(num_workers=2, timeout_s=0.5)
    scorer.score(["x"], [1])  # wait until the workers are up
    print(" ".join(map(str, scorer.pids)), flush=True)
    scorer.score([{text!r}] * 2, [1, 1])
"""


@pytest.mark.integration
def test_workers_do_not_outlive_a_killed_parent(tmp_path: Path) -> None:
    """SIGKILL the process that owns the scorer while both workers spin on 9^(9^9)."""
    script = tmp_path / "owner.py"
    script.write_text(ORPHAN_SCRIPT.format(root=str(REPO_ROOT), text=answer("9^{9^{9}}")))
    owner = psutil.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(0.2)  # let them start the heavy items
    finally:
        kill_and_clean(owner.pid)   # as the OOM killer would; its multiprocessing folder removed after it
        owner.wait()
        owner.stdout.close()
    # The kernel's per-item CPU cap (2 * ceil(0.5) + 1 = 3 CPU s) ends them; allow for a loaded CPU.
    deadline = time.monotonic() + 120
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(pids)


@pytest.mark.integration
def test_close_reaps_workers_also_on_exceptions() -> None:
    with pytest.raises(ValueError):
        with RewardScorer(num_workers=2) as pool:
            pids = pool.pids
            pool.score([answer("1")], [None])
    assert gone(pids)
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.score([answer("1")], [1])


# ----------------------------------------------------------------------------- real benchmarks


def _load_gold_script():
    path = REPO_ROOT / "benchmarks" / "reward_golds.py"
    spec = importlib.util.spec_from_file_location("reward_golds", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
def test_benchmark_golds_verify_against_themselves_not_each_other(math_data_dir) -> None:
    golds_script = _load_gold_script()
    with RewardScorer(timeout_s=20.0) as pool:
        for name in golds_script.BENCHMARKS:
            answers = golds_script.load_answers(math_data_dir, name)
            self_rate, cross_rate, failures = golds_script.gold_rates(answers, pool)
            assert self_rate >= 0.99, (name, failures[:5])
            assert cross_rate < 0.02, name
            # The same golds as models also write them: 870000000, 90°, E_1,E_2 (issue 15).
            _, variant_rate, variant_cross, failures = golds_script.variant_rates(answers, pool)
            assert variant_rate >= 0.99, (name, failures[:5])
            assert variant_cross < 0.02, name
