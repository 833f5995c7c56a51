"""Tree-packed learner rows (one row per trace, its summaries as branches) against the row-per-summary
layout, on a real rollout of a tiny model that has traces closed by `</think>` (budgets past the end
sharing one summary prompt), traces stopped by EOS and traces cut inside the thinking: the same
trained tokens, log-probs, loss, gradients and updated weights (fp64 within 1e-10, fp32 within 1e-5);
the chunked LM-head log-probs against the full logits; the FlexAttention block mask against the
dense mask."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from anytime.batch.anytime_rollout import AnytimeRollout
from tests.helpers import train_rows
from anytime.batch.train_batch import TrainBatch
from anytime.config import AlgorithmConfig, LearnerConfig

BUDGETS, TRACES, SUMMARIES = (6, 12, 18, 24), 4, 2


def stopping_model(source: str, out: Path) -> str:
    """The tiny model, edited so that it closes its thinking (`</think>`) or stops (EOS) every ten
    tokens or so: residual feature 0 is a constant (every embedding has it, no layer writes to it)
    and only those two LM-head rows read it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        for token, strength in ((tok.convert_tokens_to_ids("</think>"), 0.3), (tok.eos_token_id, 0.25)):
            model.lm_head.weight[token] = 0.0
            model.lm_head.weight[token, 0] = strength
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def real_rollout(model_dir: str) -> AnytimeRollout:
    """3 prompts × 4 traces × 4 budgets × 2 summaries of the transformers engine."""
    from transformers import AutoTokenizer

    from anytime.config.answer_format import AnswerFormat
    from anytime.data.prompts import render_prompt, synthetic_rows
    from anytime.reward.verifier import RewardScorer
    from anytime.rollout.engines.engine import create_engine
    from anytime.rollout.runner import AnytimeRolloutRunner
    from anytime.rollout.settings import AnytimeSettings

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = synthetic_rows(3, 0, 3, 4)
    with create_engine("hf", model_dir, max_model_len=256, max_prompt_len=128) as engine, \
            RewardScorer(num_workers=1) as scorer:
        runner = AnytimeRolloutRunner(engine, tok, scorer, AnytimeSettings(
            BUDGETS, traces_per_prompt=TRACES, summaries_per_budget=SUMMARIES,
            format=AnswerFormat(summary_max_tokens=5), seed=1))
        return runner.run([render_prompt(tok, r.problem) for r in rows], [r.answer for r in rows])


def advantages(rollout: AnytimeRollout, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random advantages with zeros where the layouts differ most: trace (0, 0) trains only some
    summaries (its thinking becomes an untrained, shortened trunk), trace (1, 0) trains nothing."""
    gen = torch.Generator().manual_seed(seed)
    B, G, S, A = rollout.scores.shape
    t_adv = torch.randn(B, G, S, generator=gen, dtype=torch.float64)
    s_adv = torch.randn(B, G, S, A, generator=gen, dtype=torch.float64)
    t_adv[0, 0] = 0.0
    s_adv[0, 0, -1] = 0.0
    t_adv[1, 0], s_adv[1, 0] = 0.0, 0.0
    s_adv[2, 1, 1, 0] = 0.0
    return t_adv, s_adv


def layouts(rollout: AnytimeRollout, seed: int = 0) -> tuple[TrainBatch, TrainBatch]:
    t_adv, s_adv = advantages(rollout, seed)
    kwargs = dict(summary_max_tokens=5, pad_id=0)
    return (train_rows(rollout, t_adv, s_adv, pack=False, **kwargs),
            train_rows(rollout, t_adv, s_adv, pack=True, **kwargs))


@pytest.fixture(scope="module")
def rollout_model(tiny_model_dir, tmp_path_factory) -> tuple[str, AnytimeRollout]:
    model_dir = stopping_model(tiny_model_dir, tmp_path_factory.mktemp("stopping_model"))
    rollout = real_rollout(model_dir)
    # the cases this file is about are really there
    assert rollout.natural_end.any() and rollout.eos_end.any() and (~(rollout.natural_end | rollout.eos_end)).any()
    shared = [(b, g) for b in range(rollout.prefix_group.shape[0]) for g in range(TRACES)
              if len(set(rollout.prefix_group[b, g].tolist())) < len(BUDGETS)]
    assert shared, "no trace whose budgets past its end share one summary prompt"
    assert rollout.forced_close.any() and (rollout.cut < rollout.think_len[..., None]).any()
    return model_dir, rollout


@pytest.mark.integration
def test_packed_rows_train_the_same_tokens(rollout_model):
    _, rollout = rollout_model
    rows, packed = layouts(rollout)
    B, G = rollout.think_len.shape
    assert len(packed) == B * G - 1  # trace (1, 0) trains nothing
    # trained tokens in the same order in both layouts: per trace, the thinking then the summaries
    for name in ("advantages", "rollout_logprobs"):
        assert torch.equal(getattr(rows, name)[rows.loss_mask], getattr(packed, name)[packed.loss_mask]), name
    assert torch.equal(rows.labels[rows.loss_mask], packed.labels[packed.loss_mask])
    assert torch.equal(rows.labels[rows.inserted_mask], packed.labels[packed.inserted_mask])
    assert int(rows.sequences.sum()) == len(rows) == int(packed.sequences.sum())
    assert torch.equal(rows.tokens_per_prompt, packed.tokens_per_prompt) and rows.max_len == packed.max_len
    assert not rows.packed and packed.packed
    assert int(packed.lengths.sum()) < int(rows.lengths.sum()) / 2
    # trace (0, 0): untrained thinking, kept only up to the longest cut its kept summaries see
    row = packed.select([0])
    assert not row.thinking_mask.any() and row.summary_mask.any()
    kept_cuts = rollout.cut[0, 0, :-1]
    first_branch = int(rollout.prompt_len[0] + kept_cuts.max())
    assert int(row.skip_end[0, :first_branch].abs().sum()) == 0 and row.skip_end[0, first_branch] == first_branch


@pytest.mark.integration
def test_packed_positions_and_visibility_match_the_summary_rows(rollout_model):
    """Each branch token sees exactly the tokens of its own summary row, at the same positions."""
    from anytime.models.attention import visible

    _, rollout = rollout_model
    rows, packed = layouts(rollout)
    seen = visible(packed.skip_start, packed.skip_end)
    pos = packed.position_ids
    branch_rows = [i for i in range(len(rows)) if rows.summary_mask[i].any()]
    checked = 0
    for p in range(len(packed)):
        starts = sorted(set(packed.skip_end[p].tolist()) - {0})
        for start in starts:
            cols = (packed.skip_end[p] == start).nonzero().flatten()
            last = int(cols[-1])
            context = packed.input_ids[p][seen[p, last]].tolist()
            assert pos[p, last] == len(context) - 1
            assert context in [rows.input_ids[i, : rows.lengths[i]].tolist() for i in branch_rows]
            checked += 1
    assert checked == int(rows.summary_mask.any(-1).sum())


def exact_norms(model: torch.nn.Module) -> torch.nn.Module:
    """The model with its RMSNorms computed in the model's dtype (torch's `nn.RMSNorm`, same weights
    and epsilon). The Hugging Face norms compute in float32 whatever the model's dtype, so in a
    float64 model the gradient reaching a norm is rounded to float32: a sum over a shared prefix
    rounded once (packed) or per copy (row per summary) then differs by ~1e-8 relative, and Adam's
    first step, ≈ lr · g / (|g| + eps), magnifies that on near-zero gradients to ~1e-7 in the
    weights. With exact norms only float64 summation order remains."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm") and hasattr(child, "variance_epsilon"):
                norm = torch.nn.RMSNorm(child.weight.shape[0], eps=child.variance_epsilon, dtype=child.weight.dtype)
                with torch.no_grad():
                    norm.weight.copy_(child.weight)
                setattr(parent, name, norm)
    return model


def step_configs(agg: str, lr: float, **learner: object) -> tuple[AlgorithmConfig, LearnerConfig]:
    algo = AlgorithmConfig(loss_agg=agg, clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
    # several micro-batches and LM-head chunks in both layouts
    cfg = LearnerConfig(lr=lr, weight_decay=0.1, grad_clip=0.0, micro_batch_tokens=300, logprob_chunk_tokens=7,
                        **learner)
    return algo, cfg


def one_step(learner: object, params: Callable[[], Iterator[tuple[str, torch.Tensor]]], batch: TrainBatch,
             algo: AlgorithmConfig) -> dict:
    """Old log-probs, then one mini-batch's forward/backward (gradients kept) and optimizer step;
    `params()` names the learner's weights as the full model does."""
    from anytime.learner.ppo import loss_spec

    batch.old_logprobs = learner.logprobs(batch)
    # off-policy by a little, so ratios and clipping are exercised
    batch.old_logprobs = torch.where(batch.loss_mask, batch.old_logprobs - 0.3 * batch.advantages.sin(), 0.0)
    mini = next(batch.mini_batches(batch.num_prompts))
    sums = learner.forward_backward(mini.batch, loss_spec(algo, mini, batch))
    grads = {n: p.grad.detach().clone() for n, p in params()}
    learner.optimizer_step()
    return {"old": batch.old_logprobs[batch.loss_mask], "sums": sums, "grads": grads,
            "weights": {n: p.detach().clone() for n, p in params()}}


def torch_step(model_dir: str, batch: TrainBatch, dtype: torch.dtype, agg: str, lr: float) -> dict:
    """`one_step` of the torch learner (float64 with exact norms, see `exact_norms`)."""
    from transformers import AutoModelForCausalLM

    from anytime.learner.data_parallel import TorchLearner

    algo, cfg = step_configs(agg, lr)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if dtype == torch.float64:
        exact_norms(model)
    return one_step(TorchLearner(model, cfg, total_steps=1), model.named_parameters, batch, algo)


def max_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in b)


# Adam's first step is ≈ lr · g / (|g| + eps): float32 rounding of near-zero gradients reaches the
# weights in proportion to lr, so the float32 case takes the quickstart's lr (2e-4), float64 a large one.
@pytest.mark.integration
@pytest.mark.parametrize("dtype,tol,lr", [(torch.float64, 1e-10, 1e-2), (torch.float32, 1e-5, 2e-4)],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "constant"])
def test_one_packed_step_equals_the_row_per_summary_step(rollout_model, dtype, tol, lr, agg):
    model_dir, rollout = rollout_model
    rows, packed = layouts(rollout)
    a, b = torch_step(model_dir, rows, dtype, agg, lr), torch_step(model_dir, packed, dtype, agg, lr)
    assert_same_step(a, b, tol)


def assert_same_step(a: dict, b: dict, tol: float, sums: bool = True) -> None:
    """Same old log-probs, loss and statistics, gradients and updated weights (b may hold a subset
    of the weights, and no loss: one pipeline rank's)."""
    assert float((a["old"] - b["old"]).abs().max()) <= tol
    for key in ("loss", "tokens", "entropy", "clip_frac", "ratio_mean") if sums else ():
        assert abs(a["sums"][key] - b["sums"][key]) <= tol * max(1.0, abs(a["sums"][key])), key
    assert a["sums"]["clip_frac"] > 0
    assert max(float(g.abs().max()) for g in a["grads"].values()) > 1e3 * tol  # there is a gradient to compare
    assert (grad_err := max_error(a["grads"], b["grads"])) <= tol, f"gradients differ by {grad_err}"
    assert (weight_err := max_error(a["weights"], b["weights"])) <= tol, f"updated weights differ by {weight_err}"


@pytest.mark.unit
def test_chunked_logprobs_equal_the_full_logits():
    from anytime.algo.logprobs import selected_logprobs, token_entropy, token_logprobs

    gen = torch.Generator().manual_seed(0)
    R, T, H, V = 3, 11, 16, 50
    hidden = torch.randn(R, T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64)
    labels = torch.randint(0, V, (R, T), generator=gen)
    select = torch.rand(R, T, generator=gen) < 0.7
    weights = torch.randn(R, T, 2, generator=gen, dtype=torch.float64)

    def loss(lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        return ((lp * weights[..., 0] + ent * weights[..., 1]) * select).sum()

    logits = head(hidden)
    full = (token_logprobs(logits, labels, 0.7), token_entropy(logits))
    loss(*full).backward()
    want = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None
    lp, ent = selected_logprobs(hidden, head, labels, select, chunk_tokens=4, temperature=0.7, with_entropy=True)
    assert torch.allclose(lp, torch.where(select, full[0], 0.0), rtol=0, atol=1e-12)
    assert torch.allclose(ent, torch.where(select, full[1], 0.0), rtol=0, atol=1e-12)
    loss(lp, ent).backward()
    assert torch.allclose(hidden.grad, want[0], rtol=0, atol=1e-12)
    assert torch.allclose(head.weight.grad, want[1], rtol=0, atol=1e-12)
    with torch.no_grad():
        again, none = selected_logprobs(hidden, head, labels, select, chunk_tokens=1000, temperature=0.7)
    assert none is None and torch.allclose(again, lp, rtol=0, atol=1e-12)


@pytest.mark.integration
def test_flex_block_mask_equals_the_dense_mask(rollout_model):
    """The CUDA path's BlockMask and the CPU path's dense mask are one mask (FlexAttention's forward
    runs on the CPU; only its backward does not)."""
    from torch.nn.attention.flex_attention import flex_attention

    from anytime.models.attention import block_mask, dense_mask

    _, rollout = rollout_model
    packed = layouts(rollout)[1].select([0, 1, 2])
    R, T = packed.input_ids.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(R, 2, T, 16, generator=gen) for _ in range(3))
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_mask(packed.skip_start, packed.skip_end, torch.float32))
    flex = flex_attention(q, k, v, block_mask=block_mask(packed.skip_start, packed.skip_end))
    assert torch.allclose(dense, flex, rtol=0, atol=1e-5)
