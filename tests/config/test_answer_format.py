"""The answer format (`anytime.config.answer_format`): one value validated once, whose close text must end
with the end marker (what serving needs), refused at recipe load and by the eval CLI with one message;
its tokenisation rule on a tokenizer, refused at a run's start; and the values derived from it that
have one owner each: the room a summary needs after a cut and the eval budgets."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from anytime.cli import main
from anytime.config import load_recipe
from anytime.config.answer_format import AnswerFormat, eval_budgets, summary_room
from anytime.errors import RecipeError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")
CUT_THEN_CLOSE = 'summary.close_text="</think>\\n\\n"'   # contains the end marker but does not end with it


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_default_close_text_and_the_goldens_pass():
    assert AnswerFormat().close_text == "...\n\n...\n\n</think>"
    assert AnswerFormat().close_phrase == "...\n\n...\n\n" and AnswerFormat().verifier_header == "**Final Answer**"
    recipe = load_recipe(QUICKSTART, ["summary.close_text=\"\\n\\n...\\n\\n</think>\""])   # the goldens' close text
    assert AnswerFormat.from_recipe(recipe).close_phrase == "\n\n...\n\n"


def test_a_close_text_that_holds_the_marker_but_does_not_end_with_it_is_refused_at_load_naming_the_key():
    with pytest.raises(RecipeError, match=r"`summary.close_text` '</think>\\n\\n' must end with `summary.think_end` "
                                          r"'</think>'.*vLLM.*summary.close_text='\\n\\n</think>'"):
        load_recipe(QUICKSTART, [CUT_THEN_CLOSE])


def test_train_refuses_that_recipe_before_any_work(tmp_path, capsys):
    """The must-show case end to end: `anytime train` stops at the recipe, so there is nothing to train
    and no checkpoint that `anytime export` would refuse later."""
    assert main(["train", QUICKSTART, f"trainer.output_dir={tmp_path / 'run'}", CUT_THEN_CLOSE]) == 2
    assert "`summary.close_text` '</think>\\n\\n' must end with" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_eval_cli_refuses_a_bad_close_text_with_the_same_message(capsys):
    assert main(["eval", "--model", "m", "--out", "o", "--close-text", "</think>\n\n"]) == 2
    assert "`summary.close_text` '</think>\\n\\n' must end with `summary.think_end`" in capsys.readouterr().err


@pytest.mark.parametrize("fields,message", [
    ({"close_text": "... so:"}, r"`summary.close_text` '... so:' must end with"),
    ({"close_text": "</think>...</think>"}, r"`summary.close_text` .* hold it only there"),
    ({"think_end": "</reasoning>"}, r"`summary.close_text` .* must end with `summary.think_end` '</reasoning>'"),
    ({"think_end": " "}, r"`summary.think_end` must be the model's end-of-thinking marker"),
    ({"header": "\n \n"}, r"`summary.header` must not be blank"),
    ({"summary_max_tokens": 0}, r"`summary.max_tokens` must be a positive integer"),
], ids=["no-marker", "marker-twice", "other-marker", "blank-marker", "blank-header", "no-summary"])
def test_each_rule_is_checked_once_in_the_constructor(fields, message):
    with pytest.raises(RecipeError, match=message):
        AnswerFormat(**fields)


def test_the_tokenisation_rule_on_the_tiny_tokenizer(tokenizer):
    AnswerFormat().check_tokenisation(tokenizer)   # `</think>` is a token of its own
    ids = AnswerFormat().ids(tokenizer)
    assert [ids.think_end] == tokenizer.encode("</think>", add_special_tokens=False)
    assert ids.close[-1] == ids.think_end
    with pytest.raises(RecipeError, match="`summary.think_end` '</thought>' is .* tokens.*must be one token"):
        AnswerFormat(think_end="</thought>", close_text="...</thought>").check_tokenisation(tokenizer)
    # one token alone, but merged with the text before it: a served cut would not be the trained one
    with pytest.raises(RecipeError, match="`summary.think_end` 'Answer' merges with the text around it"):
        AnswerFormat(think_end="Answer", close_text="... Answer").check_tokenisation(tokenizer)


def test_a_run_refuses_a_format_its_tokenizer_cannot_serve_before_the_warm_start(tiny_model_dir):
    from anytime.trainer.launch import prepare_model

    recipe = load_recipe(QUICKSTART, [f"model.path={tiny_model_dir}", "trainer.num_threads=0",
                                      "summary.think_end=Answer", 'summary.close_text="... Answer"'])
    with pytest.raises(RecipeError, match="merges with the text around it"):
        prepare_model(recipe)


class _Engine:
    max_model_len = 512


def test_room_after_cut_is_what_the_runner_inserts_and_what_engines_make_room_for(tokenizer):
    from anytime.rollout.runner import AnytimeRolloutRunner
    from anytime.rollout.settings import AnytimeSettings, engine_max_len

    answer_format = AnswerFormat(summary_max_tokens=7)
    runner = AnytimeRolloutRunner(_Engine(), tokenizer, None, AnytimeSettings((8, 16), 1, 1, answer_format))
    (cut, natural), _ = runner.summary_plan(12, True, False, [8, 16])   # cut at 8, ended by itself at 12
    room = answer_format.room_after_cut(tokenizer)
    assert room == runner.room_after_cut == len(cut.suffix) + 7 == summary_room(len(cut.suffix), 7)
    assert len(natural.suffix) < len(cut.suffix)   # a natural end inserts the header alone
    recipe = load_recipe(QUICKSTART, ["summary.max_tokens=7"])
    assert engine_max_len(recipe, tokenizer) == recipe.data.max_prompt_len + recipe.budget.max_thinking + room


def test_the_eval_budgets_are_eval_budgets_else_the_training_grid_wherever_they_are_read():
    from anytime.evaluation.options import recipe_options
    from anytime.serving.protocol import AnswerProtocol

    grid = load_recipe(QUICKSTART)
    own = load_recipe(QUICKSTART, ["eval.budgets=[16,48]"])
    assert eval_budgets(grid) == grid.budget.grid() == [16, 32, 48, 64] and eval_budgets(own) == [16, 48]
    for recipe in (grid, own):
        assert list(recipe_options(recipe)["budgets"]) == AnswerProtocol.from_recipe(recipe).budgets == \
            eval_budgets(recipe)


def test_the_containers_hold_the_recipes_format():
    from anytime.evaluation.options import EvalOptions, recipe_options
    from anytime.serving.protocol import AnswerProtocol
    from anytime.rollout.settings import training_settings

    recipe = load_recipe(QUICKSTART, ['summary.header="\\nANSWER\\n"', "summary.eos_ends_thinking=true"])
    answer_format = AnswerFormat.from_recipe(recipe)
    assert answer_format.verifier_header == "ANSWER" and answer_format.eos_ends_thinking
    opts = EvalOptions(**recipe_options(recipe))
    assert training_settings(recipe).format == opts.answer_format() == opts.settings(0).format == answer_format
    assert AnswerProtocol.from_recipe(recipe).format == answer_format
