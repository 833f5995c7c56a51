import json
import logging

import pytest

from anytime.data.prompts import DataError, PromptRow, encode_prompts, load_rows, synthetic_rows, user_message
from anytime.tasks.synthetic import ChainProblem, make_problems, sft_completion

pytestmark = pytest.mark.unit


def test_local_benchmarks_load_with_their_quirks(math_data_dir):
    def raw(name):
        return json.loads((math_data_dir / name).read_text())

    amc = load_rows(str(math_data_dir / "test_amc.json"))
    assert len(amc) == len(raw("test_amc.json")) >= 20 and isinstance(amc[0].answer, float)
    minerva = load_rows(str(math_data_dir / "test_minerva.json"))
    assert len(minerva) == len(raw("test_minerva.json")) >= 20 and isinstance(minerva[0].answer, list)
    assert len(load_rows(str(math_data_dir / "test_math.json"), limit=20)) == 20


def test_jsonl_and_field_mapping(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"what is {i}?", "a": str(i), "id": f"r{i}"}) for i in range(3)))
    rows = load_rows(str(path), problem_key="q", answer_key="a")
    assert rows[1] == PromptRow("r1", "what is 1?", "1")


def test_rows_without_answer_are_reported(tmp_path, caplog):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"problem": "a", "answer": "1"}, {"problem": "b"}, {"problem": "", "answer": "2"}]))
    with caplog.at_level(logging.WARNING):
        rows = load_rows(str(path))
    assert [r.problem for r in rows] == ["a"]
    assert "skipped 2 row(s)" in caplog.text and "first ids: 1, 2" in caplog.text


def test_bad_sources(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows(str(tmp_path / "nope.json"))
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"question": "a", "solution": "1"}]))
    with pytest.raises(DataError, match=r"Set data.problem_key"):
        load_rows(str(path))
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(DataError, match="not valid JSON"):
        load_rows(str(bad))


def test_synthetic_task_is_seeded_and_consistent():
    p = ChainProblem(3, (7, 2, 9, 4))
    assert p.answer == 5
    assert p.thinking() == "1: 3+7=0\n2: 0+2=2\n3: 2+9=1\n4: 1+4=5\n"
    # whole sums: each line shows its carry, the next goes on from the last digit; the answer is the same
    assert p.thinking(whole_sums=True) == "1: 3+7=10\n2: 0+2=2\n3: 2+9=11\n4: 1+4=5\n"
    assert p.problem == ("Start with 3. Step 1: add 7. Step 2: add 2. Step 3: add 9. Step 4: add 4. "
                         "What is the last digit of the result?")
    assert make_problems(5, 1) == make_problems(5, 1)
    train = synthetic_rows(200, 1, 3, 6)
    held_out = synthetic_rows(50, 2, 3, 6, exclude=train)
    assert not {r.problem for r in train} & {r.problem for r in held_out}
    import random
    text = sft_completion(p, random.Random(0), filler=0.0)
    assert text.endswith("</think>\n\n**Final Answer**\n\\boxed{5}")
    whole = sft_completion(p, random.Random(0), filler=0.0, whole_sums=True)
    assert whole.startswith("1: 3+7=10\n") and whole.endswith("\\boxed{5}")


class _Tok:
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(range(len(text.split())))}


def test_prompt_length_is_checked():
    rows = [PromptRow("x", "one two three four", "1")]
    assert encode_prompts(_Tok(), rows, "go", 10) == [[0, 1, 2, 3, 4]]
    with pytest.raises(DataError, match="above data.max_prompt_len = 3"):
        encode_prompts(_Tok(), rows, "go", 3)
    assert user_message("Q?", "Think.") == "Q? Think."
