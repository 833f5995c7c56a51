"""The decisive pipeline test: every schedule, on 2 and 4 gloo ranks, trains a tiny fp64 Qwen2
exactly like the single-process model (loss, every gradient, logprobs, and the weights after
three optimizer steps with post-validation: a plain step, a clipped step, an injected inf).

One process group per world size runs all schedules in turn, to keep spawn cost down.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from anytime.pipeline import SCHEDULES
from anytime.pipeline.runtime import _MessagePlan, forward_only_actions
from anytime.pipeline.schedule import build_schedule

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOL = 1e-10
ROWS, LENGTH, VOCAB = 8, 10, 61


def _config(layers: int, tied: bool):
    import transformers

    return transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                    num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                    max_position_embeddings=32, tie_word_embeddings=tied)


def _batch(seed: int, adv_scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    attn = torch.ones(ROWS, LENGTH, dtype=torch.long)
    attn[0, :3] = 0  # left padding on two rows
    attn[3, :1] = 0
    loss_mask = (torch.rand(ROWS, LENGTH - 1, generator=g) > 0.3).double() * attn[:, 1:]
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
            "advantages": adv_scale * torch.randn(ROWS, LENGTH - 1, generator=g, dtype=torch.float64),
            "old_logprobs": -3 * torch.rand(ROWS, LENGTH - 1, generator=g, dtype=torch.float64)}


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(config, batches: list[dict], agg: str = "token-mean") -> dict:
    """Single-process run of the same three steps; picks a clip threshold between steps 1 and 2."""
    from anytime.algo.logprobs import token_logprobs
    from anytime.algo.loss import policy_loss
    from anytime.pipeline.partition import load_causal_lm

    model = load_causal_lm(config, dtype=torch.float64, seed=0)
    opt = _adamw(list(model.parameters()))

    def loss_of(b):
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        lp = token_logprobs(logits[:, :-1], b["input_ids"][:, 1:])
        return policy_loss(lp, b["old_logprobs"], b["advantages"], b["loss_mask"], agg=agg)[0], lp

    loss_a, _ = loss_of(batches[0])
    loss_a.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm_a = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    opt.step()
    opt.zero_grad()
    loss_b, _ = loss_of(batches[1])
    loss_b.backward()
    norm_b = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    max_norm = math.sqrt(norm_a * norm_b)
    assert norm_a < max_norm < norm_b, "test setup: step 2 must clip and step 1 must not"
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    opt.zero_grad()
    # Step 3 has an inf injected into one gradient: it is skipped, weights stay.
    with torch.no_grad():
        _, lp_final = loss_of(batches[0])
    return {"loss_a": loss_a.item(), "loss_b": loss_b.item(), "grads": grads, "max_norm": max_norm,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "logprobs": lp_final}


def _lookup(table: dict, name: str) -> torch.Tensor:
    # With tied embeddings the single model names the shared matrix once.
    return table[name] if name in table else table["model.embed_tokens.weight"]


def _run_case(rank: int, world: int, config, batches, ref, case: dict) -> dict:
    from anytime.pipeline.causal_lm import PipelinedCausalLM

    learner = PipelinedCausalLM(config, case["name"], microbatches=case["m"], dtype=torch.float64, seed=0,
                              optimizer_factory=_adamw, max_grad_norm=ref["max_norm"],
                              post_validate=case.get("post_validate", True), rollback=case.get("rollback", "auto"),
                              offload_chunks=case.get("offload", ()),
                              loss_kwargs={"agg": case.get("agg", "token-mean")})
    out = learner.forward_backward(batches[0])
    grad_err = max(float((p.grad - _lookup(ref["grads"], n)).abs().max()) for n, p in learner.named_parameters())
    loss_err = abs(out["loss"] - ref["loss_a"]) if out["loss"] is not None else None
    learner.optimizer_step()
    if case.get("lazy"):
        # Validation left pending: each step's result is picked up before the next forward.
        learner.train_step(batches[1], wait=False)
        m_a = learner.last_metrics
        learner.forward_backward(batches[2])
        m_b = learner.last_metrics
    else:
        m_a = learner.validate()
        learner.forward_backward(batches[1])
        learner.optimizer_step()
        m_b = learner.validate()
        learner.forward_backward(batches[2])
    if rank == world - 1:
        _, p = next(learner.named_parameters())
        p.grad.view(-1)[0] = float("inf")
    learner.optimizer_step()
    m_c = learner.validate()
    weight_err = max(float((p.detach() - _lookup(ref["weights"], n)).abs().max())
                     for n, p in learner.named_parameters())
    lp_err = float((learner.logprobs(batches[0]) - ref["logprobs"]).abs().max())
    names = sorted(n for n, _ in learner.named_parameters())
    stats = learner.executor.saved.stats
    return {"grad_err": grad_err, "loss_err": loss_err, "weight_err": weight_err, "logprob_err": lp_err,
            "metric_loss_err": [abs(m_a["loss"] - ref["loss_a"]), abs(m_b["loss"] - ref["loss_b"])],
            "clipped": [m_a["clipped"], m_b["clipped"], m_c["clipped"]],
            "skipped": [m_a["skipped"], m_b["skipped"], m_c["skipped"]],
            "rolled_back": [m_a["rolled_back"], m_b["rolled_back"], m_c["rolled_back"]],
            "params": names, "offloaded": stats.offloaded, "reloaded": stats.reloaded, "freed": stats.freed}


def _worker(rank: int, world: int, init_file: str, out_dir: str, layers: int, tied: bool, cases: list) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        config = _config(layers, tied)
        batches = [_batch(1), _batch(2, adv_scale=200.0), _batch(3)]
        refs = {agg: _reference(config, batches, agg) for agg in {c.get("agg", "token-mean") for c in cases}}
        results = {case["id"]: _run_case(rank, world, config, batches, refs[case.get("agg", "token-mean")], case)
                   for case in cases}
        results["_reference_params"] = sorted(refs["token-mean"]["weights"])
        results["_errors"] = _bad_inputs(config)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _bad_inputs(config) -> list[str]:
    """Messages of the errors raised for a mis-sized batch and a wrong stage set."""
    from anytime.pipeline.causal_lm import PipelinedCausalLM
    from anytime.pipeline.runtime import PipelineExecutor

    learner = PipelinedCausalLM(config, "1f1b", microbatches=4, dtype=torch.float64)
    bad = {k: v[:7] for k, v in _batch(1).items()}
    messages = []
    for call in (lambda: learner.forward_backward(bad),
                 lambda: PipelineExecutor({}, build_schedule("zb-v", dist.get_world_size(), 2))):
        try:
            call()
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


def _spawn(tmp_path, world: int, layers: int, tied: bool, cases: list[dict]) -> list[dict]:
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(tmp_path), layers, tied, cases), nprocs=world)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _cases(m: int) -> list[dict]:
    return [{"id": name, "name": name, "m": m} for name in SCHEDULES.names()]


def _check(results: list[dict], cases: list[dict], world: int) -> None:
    for case in cases:
        rows = [r[case["id"]] for r in results]
        where = f"{case['id']} on {world} ranks"
        for r, row in enumerate(rows):
            assert row["grad_err"] <= TOL, f"{where}: rank {r} gradient differs by {row['grad_err']:.3g}"
            assert row["weight_err"] <= TOL, f"{where}: rank {r} weights differ by {row['weight_err']:.3g}"
            assert row["logprob_err"] <= TOL, f"{where}: rank {r} logprobs differ by {row['logprob_err']:.3g}"
            assert max(row["metric_loss_err"]) <= TOL, f"{where}: rank {r} reduced loss {row['metric_loss_err']}"
            assert row["clipped"] == [False, True, False], f"{where}: clipping {row['clipped']}"
            assert row["skipped"] == [False, False, True], f"{where}: inf skip {row['skipped']}"
        losses = [row["loss_err"] for row in rows if row["loss_err"] is not None]
        assert len(losses) == 1 and losses[0] <= TOL, f"{where}: loss error {losses}"
        # Every parameter of the model is held by some rank (a tied head shared on one rank is
        # listed once, under the embedding's name).
        held = {n for row in rows for n in row["params"]} - {"lm_head.weight"}
        assert held == set(results[0]["_reference_params"]) - {"lm_head.weight"}, f"{where}: held {sorted(held)}"
        if case.get("post_validate", True):
            # Ranks that stepped speculatively in step 3 must have undone it.
            assert any(row["rolled_back"][2] for row in rows), f"{where}: no rollback on the inf step"
            assert not any(row["rolled_back"][0] for row in rows), f"{where}: rollback on a clean step"
        if case.get("offload"):
            assert all(row["offloaded"] > 0 and row["offloaded"] == row["reloaded"] == row["freed"]
                       for row in rows), f"{where}: offload bytes {[(r['offloaded'], r['reloaded']) for r in rows]}"


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_every_schedule_matches_single_process_on_2_ranks(tmp_path):
    cases = _cases(4) + [
        {"id": "1f1b-m2-blocking", "name": "1f1b", "m": 2, "post_validate": False},
        {"id": "zb-h1-snapshot", "name": "zb-h1", "m": 8, "rollback": "snapshot"},
        {"id": "zb-v-offload", "name": "zb-v", "m": 4, "offload": [0, 1]},
        {"id": "zb-v-seq-mean", "name": "zb-v", "m": 4, "agg": "seq-mean-token-mean"},
        {"id": "v-half-constant", "name": "v-half", "m": 8, "agg": "constant"},
        {"id": "zb-h2-lazy-validation", "name": "zb-h2", "m": 4, "lazy": True},
    ]
    results = _spawn(tmp_path, 2, 4, False, cases)
    _check(results, cases, 2)
    assert "7 rows, not divisible by microbatches=4" in results[0]["_errors"][0]
    assert "rank 0 must hold stages [0, 3]" in results[0]["_errors"][1]


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_every_schedule_matches_single_process_on_4_ranks_with_tied_embeddings(tmp_path):
    cases = _cases(4) + [
        {"id": "zb-h1-m8", "name": "zb-h1", "m": 8},
        {"id": "interleaved-offload", "name": "interleaved-1f1b", "m": 4, "offload": [0]},
    ]
    _check(_spawn(tmp_path, 4, 8, True, cases), cases, 4)


# -- single-process checks of the executor's communication plan --------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("name", SCHEDULES.names())
def test_receives_follow_the_senders_order(name):
    """Per direction of a rank pair, the receiver posts in exactly the order the sender sends
    (what NCCL's order matching needs), and every cross-rank message is planned once."""
    schedule = build_schedule(name, 4, 8)
    plans = {r: _MessagePlan(schedule.actions, schedule.placement, r) for r in range(4)}
    total = 0
    for dst, plan in plans.items():
        for src, keys in plan.from_rank.items():
            sent = [k for k, _ in sorted(plans[src].send_index.items(), key=lambda kv: kv[1])
                    if schedule.placement[k[1]] == dst]
            assert keys == sent
            total += len(keys)
    cross = sum(1 for s in range(schedule.stages - 1) if schedule.placement[s] != schedule.placement[s + 1])
    assert total == 2 * cross * schedule.microbatches  # one activation and one gradient per edge and microbatch


@pytest.mark.unit
def test_forward_only_order_is_a_wavefront_on_v_placement():
    schedule = build_schedule("zb-v", 2, 3)
    order = forward_only_actions(schedule)
    assert [str(a) for a in order[0]] == ["0F0", "0F1", "0F2", "3F0", "3F1", "3F2"]
    assert [str(a) for a in order[1]] == ["1F0", "1F1", "2F0", "1F2", "2F1", "2F2"]
