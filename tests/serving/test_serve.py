"""`anytime serve` on the CPU: vLLM's OpenAI server for an exported tiny model answers at every budget of
the recipe exactly as `anytime eval` scored it, token for token (cut traces and traces that closed their
thinking before the budget), and refuses bad budgets with an HTTP 400."""

import contextlib
import importlib.util
import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch

HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAS_VLLM, reason="needs vllm")]

RECIPE_OVERRIDES = ["budget.budgets=[4,8,16,24]", "budget.max_thinking=24", "summary.max_tokens=8"]


def _model_that_closes_its_thinking(src: str, out: Path) -> None:
    """The tiny model with `</think>`'s output row copied (x1.05) from a token its greedy traces repeat,
    so that some traces close their thinking by themselves within the budgets and some are cut."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(src, out)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Start with 3. Add 4."}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    ids = model.generate(**prompt, max_new_tokens=12, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    repeated = int(torch.mode(ids).values)
    weights = load_file(str(out / "model.safetensors"))
    key = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[key][tok.convert_tokens_to_ids("</think>")] = weights[key][repeated] * 1.05
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def exported_run(tiny_model_dir, tmp_path_factory):
    """A run folder (recipe.yaml + a checkpoint) exported as `anytime export` does it."""
    from anytime.config import load_recipe
    from anytime.serving.export import export_checkpoint

    run = tmp_path_factory.mktemp("run")
    step = run / "checkpoints" / "step_1"
    step.parent.mkdir(parents=True)
    _model_that_closes_its_thinking(tiny_model_dir, step)
    (step / "trainer_state.json").write_text("{}")   # what makes a run's checkpoint complete
    recipe = load_recipe("recipes/quickstart.yaml", RECIPE_OVERRIDES)
    (run / "recipe.yaml").write_text(recipe.to_yaml())
    folder, diff = export_checkpoint(step, run / "export")
    assert diff <= 1e-5
    return recipe, folder


@contextlib.contextmanager
def served(folder: Path):
    import openai

    from anytime.serving.serve import running_server

    flags = ["--max-model-len", "512", "--dtype", "float32", "--block-size", "32", "--enforce-eager",
             "--kv-cache-memory-bytes", str(256 << 20), "--served-model-name", "tiny"]
    log = folder.parent / "serve.log"
    try:
        with running_server(folder, flags, log, startup_s=300) as url:
            yield openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    except RuntimeError as exc:
        raise AssertionError(f"{exc}:\n{log.read_text()[-3000:]}") from None


def _evaluated(recipe, folder: Path, n_problems: int):
    """`anytime eval`'s rollout of the recipe's held-out problems with greedy decoding, and the prompts."""
    import dataclasses

    from transformers import AutoTokenizer

    from anytime.data.benchmarks import load_benchmark
    from anytime.data.prompts import encode_prompts
    from anytime.evaluation.options import EvalOptions, recipe_options
    from anytime.reward.verifier import RewardScorer
    from anytime.rollout.engines.engine import create_engine
    from anytime.rollout.runner import AnytimeRolloutRunner

    opts = dataclasses.replace(EvalOptions(**recipe_options(recipe)), temperature=0.0, samples=1, engine="vllm")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = load_benchmark("synthetic", limit=n_problems)
    prompts = encode_prompts(tokenizer, rows, opts.instruction, opts.max_prompt_len)
    with create_engine("vllm", str(folder), max_model_len=512, max_prompt_len=opts.max_prompt_len,
                       dtype="float32", seed=0) as engine, \
            RewardScorer(num_workers=1, header=opts.answer_format().verifier_header,
                         think_end=opts.think_end) as scorer:
        runner = AnytimeRolloutRunner(engine, tokenizer, scorer, opts.settings(0))
        rollout = runner.run(prompts, [r.answer for r in rows], list(opts.budgets), seed=0)
    return rollout, prompts, tokenizer


def _expected_ids(rollout, i: int, j: int) -> list[int]:
    """What `anytime eval` scored for problem i at budget j: kept thinking, inserted tokens, summary."""
    cut = int(rollout.cut[i, 0, j])
    inserted = list(rollout.close_ids) if bool(rollout.forced_close[i, 0, j]) else []
    summary = rollout.summary_ids[i, 0, j, 0, :int(rollout.summary_len[i, 0, j, 0])].tolist()
    return rollout.think_ids[i, 0, :cut].tolist() + inserted + list(rollout.header_ids) + summary


def test_served_answers_are_the_evaluated_ones_at_every_budget(exported_run):
    from anytime.serving.protocol import AnswerProtocol

    recipe, folder = exported_run
    protocol = AnswerProtocol.read(folder)
    assert protocol is not None and protocol.budgets == [4, 8, 16, 24] and protocol.format.summary_max_tokens == 8
    rollout, prompts, tokenizer = _evaluated(recipe, folder, n_problems=6)
    eos = tokenizer.eos_token_id
    compared = {"cut": 0, "closed by itself": 0}
    with served(folder) as client:
        for i, prompt in enumerate(prompts):
            if bool(rollout.eos_end[i, 0]):
                continue   # a trace that stopped on EOS ends the served response: the eval scores it 0
            for j, budget in enumerate(protocol.budgets):
                response = client.completions.create(
                    model="tiny", prompt=prompt, temperature=0, max_tokens=protocol.request_budget(budget) + 64,
                    extra_body={"thinking_token_budget": protocol.request_budget(budget), "return_token_ids": True})
                choice = response.choices[0]
                got = list(choice.model_extra["token_ids"])
                got = got[:-1] if got and got[-1] == eos else got
                want = _expected_ids(rollout, i, j)
                want = want[:-1] if want and want[-1] == eos else want
                assert got == want, f"problem {i} at budget {budget}: served {got} vs evaluated {want}"
                assert choice.text == tokenizer.decode(got, skip_special_tokens=False) or got == want
                compared["cut" if bool(rollout.forced_close[i, 0, j]) else "closed by itself"] += 1
        assert compared["cut"] > 0 and compared["closed by itself"] > 0, compared

        # the chat route splits the thinking from the answer (the reasoning parser; it reads the end marker
        # in the text, so a tokenizer that marks it special needs skip_special_tokens off)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Start with 3. Add 4."}], temperature=0,
            max_tokens=64, extra_body={"thinking_token_budget": protocol.request_budget(4), "skip_special_tokens": False})
        message = chat.choices[0].message
        assert (message.content or "").startswith(protocol.format.header), message

        # bad budgets: an HTTP 400 that names the field, and the server keeps serving
        import openai

        for budget, extra in ((-5, {}), (3.5, {}), (10_000, {}), (40, {"max_tokens": 30})):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model="tiny", prompt=prompts[0], temperature=0,
                                          extra_body={"thinking_token_budget": budget, **extra})
            assert "thinking_token_budget" in str(err.value), err.value
        assert client.completions.create(model="tiny", prompt=prompts[0], max_tokens=4).choices[0].text is not None


def test_export_writes_the_protocol_the_sampling_and_a_model_card(exported_run):
    recipe, folder = exported_run
    protocol = json.loads((folder / "anytime_protocol.json").read_text())
    assert protocol["close_text"] == recipe.summary.close_text and protocol["header"] == recipe.summary.header
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["temperature"] == recipe.eval.temperature and generation["top_p"] == recipe.eval.top_p
    card = (folder / "README.md").read_text()
    assert f"anytime serve {folder}" in card and "No eval of the run was found" in card   # none beside it
    # the request to paste is one shell command whose JSON asks for the first budget
    curl = shlex.split(card.split("```bash\n")[-1].split("```")[0])
    request = json.loads(curl[curl.index("-d") + 1])
    from anytime.serving.protocol import AnswerProtocol

    assert request["thinking_token_budget"] == AnswerProtocol.read(folder).request_budget(protocol["budgets"][0])


def test_serve_without_a_protocol_warns_what_it_assumed(tiny_model_dir, tmp_path, caplog):
    from anytime.cli import main

    folder = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "anytime_protocol.json").unlink(missing_ok=True)
    with caplog.at_level("WARNING"):
        assert main(["serve", str(folder), "--print-command", "--port", "8001"]) == 0
    assert "holds no anytime_protocol.json" in caplog.text and "defaults" in caplog.text


def test_serve_of_a_run_folder_exports_its_newest_checkpoint(exported_run, capsys):
    from anytime.cli import main

    _, folder = exported_run
    run = folder.parent
    assert main(["serve", str(run), "--print-command"]) == 0
    command = capsys.readouterr().out
    assert command.startswith(f"vllm serve {run / 'export'} --reasoning-config") and "--logits-processors" in command
    assert (run / "export" / ".exported_from").read_text() == "step_1"
    assert main(["serve", str(run / "missing")]) == 2
