"""`rollout.logprobs`: raw log-probs are not those of the distribution a token was sampled from when
the temperature is not 1 or top-p is below 1. In `processed` mode the engines return the sampled
distribution's log-probs and the learner computes its own under the same temperature and top-p: the
gap between the two closes. Shown at temperature 0.6, top-p 0.95 on both engines."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from anytime.algo.logprobs import SamplingProcessing, processed_logits, selected_logprobs
from anytime.rollout.engines.engine import SamplingConfig, create_engine

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 30, 31, 32]]
SAMPLING = SamplingConfig(max_new_tokens=24, n=2, temperature=0.6, top_p=0.95, seed=3)
PROCESSING = SamplingProcessing(0.6, 0.95, 0.6, 0.95)


def learner_logprobs(model, prompt: list[int], tokens: list[int], processed: bool) -> torch.Tensor:
    """The learner's path: hidden states through the LM head in chunks (`selected_logprobs`)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1]
        labels = ids[:, 1:]
        select = torch.zeros_like(labels, dtype=torch.bool)
        select[:, len(prompt) - 1:] = True
        mask = select.clone()
        per_token = PROCESSING.per_token(mask, torch.zeros_like(mask)) if processed else None
        lp, _ = selected_logprobs(hidden, model.get_output_embeddings(), labels, select, chunk_tokens=7,
                                  processing=per_token)
    return lp[0, len(prompt) - 1:]


def gaps(engine_kind: str, model_dir: str, model) -> dict[str, float]:
    """Mean |engine - learner| over every sampled token, for each pairing of modes."""
    out = {}
    samples = {}
    for mode in ("raw", "processed"):
        with create_engine(engine_kind, model_dir, max_model_len=64, logprobs=mode) as eng:
            samples[mode] = eng.generate(PROMPTS, SAMPLING)
    for engine_mode in ("raw", "processed"):
        for learner_mode in ("raw", "processed"):
            diffs = []
            for prompt, per_prompt in zip(PROMPTS, samples[engine_mode]):
                for c in per_prompt:
                    learner = learner_logprobs(model, prompt, c.token_ids, learner_mode == "processed")
                    diffs.append((torch.tensor(c.logprobs, dtype=torch.float64) - learner.double()).abs())
            out[f"{engine_mode}_vs_{learner_mode}"] = float(torch.cat(diffs).mean())
    # the same seeds sample the same tokens in either mode: only what is reported differs
    assert [[c.token_ids for c in p] for p in samples["raw"]] == [[c.token_ids for c in p] for p in samples["processed"]]
    return out


def assert_gap_closes(g: dict[str, float]) -> None:
    # before: the raw log-probs an engine reports are far from the distribution it sampled from
    assert g["raw_vs_processed"] > 0.1
    # after: processed on both sides agree up to the numerics, as raw on both sides does
    assert g["processed_vs_processed"] < 1e-3 and g["raw_vs_raw"] < 1e-3


@pytest.mark.unit
def test_processed_logits_follow_the_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    expected = TopPLogitsWarper(0.8)(None, TemperatureLogitsWarper(0.7)(None, logits))
    got = processed_logits(logits, torch.full((6,), 0.7), torch.full((6,), 0.8))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.allclose(got[~torch.isinf(got)], expected[~torch.isinf(expected)])
    # the sampled token always stays in the nucleus, even where rounding would push it out
    outside = int(torch.isinf(expected[0]).nonzero()[0])
    kept = processed_logits(logits, torch.full((6,), 0.7), torch.full((6,), 0.8), keep=torch.full((6,), outside))
    assert torch.isfinite(kept[:, outside]).all()
    # top-p 1 is the temperature alone
    assert torch.equal(processed_logits(logits, torch.full((6,), 0.7), torch.ones(6)), logits / 0.7)


@pytest.mark.unit
def test_hf_engine_and_learner_agree_in_either_mode(tiny_model_dir):
    g = gaps("hf", tiny_model_dir, AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval())
    assert_gap_closes(g)


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_engine_and_learner_agree_in_either_mode(tiny_model_dir):
    pytest.importorskip("vllm")
    g = gaps("vllm", tiny_model_dir, AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval())
    assert_gap_closes(g)


@pytest.mark.unit
def test_the_recipe_names_the_processing_and_refuses_it_where_unsupported():
    from anytime.config import RecipeError, load_recipe
    from anytime.learner.factory import sampling_processing
    from tests.helpers import QUICKSTART

    sampled = ["rollout.temperature=0.6", "rollout.top_p=0.95", "summary.temperature=0.8"]
    assert sampling_processing(load_recipe(QUICKSTART, sampled)) is None   # raw by default
    processed = load_recipe(QUICKSTART, [*sampled, "rollout.logprobs=processed"])
    assert sampling_processing(processed) == SamplingProcessing(0.6, 0.95, 0.8, 0.95)
    temperature, top_p = SamplingProcessing(0.6, 0.95, 0.8, 0.95).per_token(
        torch.tensor([[True, False]]), torch.tensor([[False, True]]))
    assert temperature[0].tolist() == pytest.approx([0.6, 0.8]) and top_p[0].tolist() == pytest.approx([0.95, 0.95])
    with pytest.raises(RecipeError, match="not supported by the pipelined learner"):
        load_recipe(QUICKSTART, ["rollout.logprobs=processed", "learner.pipeline.stages=2"])


@pytest.mark.e2e
def test_a_processed_run_trains_with_engine_and_learner_in_agreement(tmp_path):
    """Two steps at temperature 0.6, top-p 0.95 with `rollout.logprobs: processed`: the learner's
    log-probs before the update equal the engine's (the summary tokens at their own temperature)."""
    import subprocess
    import sys

    from tests.helpers import QUICKSTART, read_metrics, tiny_overrides

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "anytime.cli", "train", QUICKSTART, *tiny_overrides(out, steps=2),
           "rollout.temperature=0.6", "rollout.top_p=0.95", "summary.temperature=0.8", "rollout.logprobs=processed"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for step, m in read_metrics(out).items():
        assert m["train/logprob_mismatch"] < 1e-4, step
