"""Rollout engines: hf (transformers) and vllm agree with the learner's model and with each other."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from anytime.models.tiny import build_tiny_model
from anytime.rollout.engines.engine import Branch, EngineError, SamplingConfig, create_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CORPUS = [
    f"Q: {a} plus {b}? <think>\n{a}+{b}={a + b}\n</think>\n\\boxed{{{a + b}}}" for a in range(30) for b in range(30)
]
MAX_LEN = 256
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 3], [1, 20, 21, 3], list(range(5, 60))]
CLOSE = 4  # </think>


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS, seed=0))


@pytest.fixture(scope="module")
def learner(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def hf(model_dir):
    with create_engine("hf", model_dir, max_model_len=MAX_LEN, max_prompt_len=64) as eng:
        yield eng


TRANSFER = ["init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"]


def recorded(engine) -> list[tuple[str, object]]:
    """Every control call the engine makes from now on, its weight loader's too: (method, or collective_rpc's
    method; its reply). Call it before the engine's first weight load (the loader takes the frontend then)."""
    calls: list[tuple[str, object]] = []
    api = engine._api

    def recording(method, *args, **kwargs):
        reply = api(method, *args, **kwargs)
        calls.append((args[0] if method == "collective_rpc" else method, reply))
        return reply

    engine._api = recording
    return calls


@torch.no_grad()
def reference_greedy(model, prompt, steps):
    """The learner's greedy continuation: full forward, argmax, no cache (slow but unambiguous)."""
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        tok = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return ids[len(prompt) :], logprobs


@torch.no_grad()
def reference_logprobs(model, prompt, completion):
    """Raw log-probabilities of ``completion`` given ``prompt`` under ``model`` (teacher forcing)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[pos, torch.tensor(completion)].tolist()


def perturbed_copy(model_dir, scale=0.05, seed=7):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def make_prefixes(hf_engine):
    """Two prefixes (prompt + a 40-token greedy trace) and branches covering the edge cases: a cut at
    0, an empty suffix, a cut at the very end, suffixes of different lengths."""
    traces = hf_engine.generate([PROMPTS[0], PROMPTS[2]], SamplingConfig(max_new_tokens=40, temperature=0))
    prefixes = [PROMPTS[0] + traces[0][0].token_ids, PROMPTS[2] + traces[1][0].token_ids]
    branches = [
        [Branch(5, (CLOSE, 7)), Branch(20, ()), Branch(len(prefixes[0]), (CLOSE,))],
        [Branch(0, (9, 9, 9)), Branch(60, (CLOSE, 2, 1, 1)), Branch(70, (CLOSE,))],
    ]
    return prefixes, branches


def assert_close_logprobs(a, b, tol=1e-3):
    assert len(a) == len(b)
    assert max(abs(x - y) for x, y in zip(a, b)) < tol


# ---- config and factory ----------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "n": 0}, "n must be"),
        ({"max_new_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
    ],
)
def test_sampling_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


@pytest.mark.unit
def test_sampling_config_normalises_stop_ids():
    cfg = SamplingConfig(max_new_tokens=3, stop_token_ids=[4, 2])
    assert cfg.stop_token_ids == (4, 2) and hash(cfg)
    assert Branch(3, [1, 2]).suffix == (1, 2)


@pytest.mark.integration
def test_create_engine_rejects_unknown_kind(model_dir):
    with pytest.raises(ValueError, match="one of 'hf', 'vllm'"):
        create_engine("sglang", model_dir, max_model_len=64)


@pytest.mark.integration
def test_hf_engine_rejects_lengths_the_model_cannot_serve(model_dir):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        create_engine("hf", model_dir, max_model_len=10_000)
    with pytest.raises(ValueError, match="max_prompt_len"):
        create_engine("hf", model_dir, max_model_len=64, max_prompt_len=64)


# ---- hf engine --------------------------------------------------------------------------------


@pytest.mark.integration
def test_hf_greedy_matches_learner(hf, learner):
    out = hf.generate(PROMPTS, SamplingConfig(max_new_tokens=30, temperature=0, n=2))
    assert [len(o) for o in out] == [2, 2, 2]
    for prompt, samples in zip(PROMPTS, out):
        ref_ids, ref_lp = reference_greedy(learner, prompt, 30)
        for c in samples:
            assert c.token_ids == ref_ids
            assert c.finish_reason == "length"
            assert_close_logprobs(c.logprobs, ref_lp, 1e-4)


def naive_branches(engine, prefixes, branches, params):
    engine.prefix_reuse = False
    try:
        return engine.generate_branches(prefixes, branches, params)
    finally:
        engine.prefix_reuse = True


@pytest.mark.integration
def test_hf_prefix_reuse_equals_naive_reprefill(hf, learner):
    max_new = 20
    params = SamplingConfig(max_new_tokens=max_new, temperature=0, n=2)
    prefixes, branches = make_prefixes(hf)
    assert hf._kept  # generate() kept the traces' KV ...
    from_thinking_kv = hf.generate_branches(prefixes, branches, params)
    assert not hf._kept  # ... and the summaries released it
    prefilled = hf.generate_branches(prefixes, branches, params)  # now each prefix is prefilled once
    naive = naive_branches(hf, prefixes, branches, params)
    assert [[len(b) for b in p] for p in from_thinking_kv] == [[2, 2, 2], [2, 2, 2]]
    for i, (prefix, brs) in enumerate(zip(prefixes, branches)):
        for j, br in enumerate(brs):
            ref_ids, ref_lp = reference_greedy(learner, prefix[: br.cut] + list(br.suffix), max_new)
            for k in range(2):
                for got in (from_thinking_kv, prefilled, naive):
                    assert got[i][j][k].token_ids == ref_ids, (i, j, k)
                    assert_close_logprobs(got[i][j][k].logprobs, ref_lp, 1e-4)


@pytest.mark.integration
def test_hf_kept_kv_of_early_stopped_traces(hf):
    """Traces that stop at different steps (rows dropped from the batch mid-way) keep exactly their
    own KV: summaries from it equal summaries from a fresh prefill of each branch prompt."""
    stop = tuple(range(0, 512, 7))
    traces = hf.generate(PROMPTS, SamplingConfig(max_new_tokens=40, n=4, stop_token_ids=stop, seed=1))
    lengths = {len(c.token_ids) for per_prompt in traces for c in per_prompt}
    assert len(lengths) >= 3 and min(lengths) < 20  # rows finished at different steps
    prefixes, branches = [], []
    for prompt, per_prompt in zip(PROMPTS, traces):
        for c in per_prompt:
            prefix = prompt + c.token_ids
            prefixes.append(prefix)
            branches.append([Branch(len(prompt) + len(c.token_ids) // 2, (CLOSE, 9)), Branch(len(prefix), ())])
    params = SamplingConfig(max_new_tokens=6, temperature=0)
    assert all(tuple(p[:-1]) in hf._kept for p in prefixes)
    reused = hf.generate_branches(prefixes, branches, params)
    naive = naive_branches(hf, prefixes, branches, params)
    for a, b in zip(reused, naive):
        for x, y in zip(a, b):
            assert x[0].token_ids == y[0].token_ids
            assert_close_logprobs(x[0].logprobs, y[0].logprobs, 1e-4)


@pytest.mark.integration
def test_hf_branches_chunked_batches_agree(model_dir, hf):
    """A tiny max_batch_rows splits the work into many chunks; results must not change."""
    prefixes, branches = make_prefixes(hf)
    params = SamplingConfig(max_new_tokens=8, temperature=0)
    with create_engine("hf", model_dir, max_model_len=MAX_LEN, max_batch_rows=2) as small:
        a = small.generate_branches(prefixes, branches, params)
        b = hf.generate_branches(prefixes, branches, params)
        flat_a = [c for per_prefix in a for per_branch in per_prefix for c in per_branch]
        flat_b = [c for per_prefix in b for per_branch in per_prefix for c in per_branch]
        a, b = small.generate(PROMPTS, params), hf.generate(PROMPTS, params)
        flat_a += [c for per_prompt in a for c in per_prompt]
        flat_b += [c for per_prompt in b for c in per_prompt]
    assert len(flat_a) == len(flat_b) == 9
    for x, y in zip(flat_a, flat_b):
        assert x.token_ids == y.token_ids  # batch composition only moves float rounding
        assert_close_logprobs(x.logprobs, y.logprobs, 1e-4)


@pytest.mark.integration
def test_hf_sampling_is_seeded_and_logprobs_are_raw(hf, learner):
    params = SamplingConfig(max_new_tokens=20, n=3, temperature=1.7, top_p=0.9, seed=11)
    first = hf.generate(PROMPTS, params)
    assert first == hf.generate(PROMPTS, params)
    assert first != hf.generate(PROMPTS, SamplingConfig(max_new_tokens=20, n=3, temperature=1.7, top_p=0.9, seed=12))
    assert len({tuple(c.token_ids) for c in first[0]}) > 1  # the n samples differ
    # logprobs are of the raw model (no temperature / top-p), checked against teacher forcing
    for prompt, samples in zip(PROMPTS, first):
        for c in samples:
            assert_close_logprobs(c.logprobs, reference_logprobs(learner, prompt, c.token_ids), 1e-4)


@pytest.mark.integration
def test_hf_tiny_top_p_is_greedy(hf):
    greedy = hf.generate(PROMPTS, SamplingConfig(max_new_tokens=15, temperature=0))
    nucleus = hf.generate(PROMPTS, SamplingConfig(max_new_tokens=15, temperature=1.0, top_p=1e-6, seed=3))
    assert [o[0].token_ids for o in nucleus] == [o[0].token_ids for o in greedy]


@pytest.mark.integration
def test_hf_stops_after_stop_token(hf):
    # With a wide stop set, random sampling hits one quickly; the stop token is kept and is last.
    stop = tuple(range(0, 512, 3))
    out = hf.generate(PROMPTS, SamplingConfig(max_new_tokens=60, n=4, stop_token_ids=stop, seed=0))
    finished = [c for samples in out for c in samples]
    assert any(c.finish_reason == "stop" for c in finished)
    for c in finished:
        hits = [i for i, t in enumerate(c.token_ids) if t in stop]
        if c.finish_reason == "stop":
            assert hits == [len(c.token_ids) - 1]
        else:
            assert hits == [] and len(c.token_ids) == 60
        assert len(c.logprobs) == len(c.token_ids)


@pytest.mark.integration
def test_hf_update_weights_changes_output_and_matches_learner(model_dir):
    new = perturbed_copy(model_dir)
    params = SamplingConfig(max_new_tokens=25, temperature=0)
    with create_engine("hf", model_dir, max_model_len=MAX_LEN) as eng:
        before = eng.generate(PROMPTS, params)
        eng.update_weights(new.named_parameters())
        after = eng.generate(PROMPTS, params)
    for prompt, b, a in zip(PROMPTS, before, after):
        assert a[0].token_ids != b[0].token_ids
        assert a[0].token_ids == reference_greedy(new, prompt, 25)[0]


@pytest.mark.integration
def test_hf_update_weights_is_strict_and_atomic(model_dir):
    params = SamplingConfig(max_new_tokens=10, temperature=0)
    new = perturbed_copy(model_dir)
    with create_engine("hf", model_dir, max_model_len=MAX_LEN) as eng:
        before = eng.generate(PROMPTS, params)
        good = list(new.named_parameters())
        with pytest.raises(ValueError, match="names the model does not have"):
            eng.update_weights(good + [("module.lm_head.weight", torch.zeros(512, 128))])
        with pytest.raises(ValueError, match="shape mismatch"):
            eng.update_weights(good[:-1] + [(good[-1][0], torch.zeros(3, 3))])
        assert eng.generate(PROMPTS, params) == before  # nothing was copied


class _ForwardCounter:
    """Counts model forward calls through a hook, to prove validation precedes any generation."""

    def __init__(self, model):
        self.calls = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1

    def remove(self):
        self._handle.remove()


@pytest.mark.integration
def test_bad_requests_fail_before_generation(hf):
    counter = _ForwardCounter(hf.model)
    ok = SamplingConfig(max_new_tokens=8)
    prefixes = [list(range(5, 45))]
    try:
        with pytest.raises(ValueError, match="max_prompt_len=64"):
            hf.generate([PROMPTS[0], list(range(5, 75))], ok)
        with pytest.raises(ValueError, match="max_model_len=256"):
            hf.generate([PROMPTS[0], PROMPTS[1]], SamplingConfig(max_new_tokens=250))
        with pytest.raises(ValueError, match="empty"):
            hf.generate([PROMPTS[0], []], ok)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            hf.generate([PROMPTS[0], [1, 9999]], ok)
        with pytest.raises(ValueError, match="stop_token_ids"):
            hf.generate([PROMPTS[0]], SamplingConfig(max_new_tokens=8, stop_token_ids=(600,)))
        with pytest.raises(ValueError, match=r"cut=41 is outside prefix 0 \(length 40\)"):
            hf.generate_branches(prefixes, [[Branch(10, (CLOSE,)), Branch(41, (CLOSE,))]], ok)
        with pytest.raises(ValueError, match="outside prefix"):
            hf.generate_branches(prefixes, [[Branch(-1, (CLOSE,))]], ok)
        with pytest.raises(ValueError, match="max_model_len"):
            hf.generate_branches(prefixes, [[Branch(30, (CLOSE,) * 10)]], SamplingConfig(max_new_tokens=220))
        with pytest.raises(ValueError, match="one list of branches per prefix"):
            hf.generate_branches(prefixes, [], ok)
        assert counter.calls == 0
        # Branch prompts hold thinking: they are bounded by max_model_len, not max_prompt_len.
        out = hf.generate_branches([list(range(5, 105))], [[Branch(100, (CLOSE,))]], SamplingConfig(max_new_tokens=2))
        assert len(out[0][0][0].token_ids) == 2
    finally:
        counter.remove()


@pytest.mark.integration
def test_closed_engine_refuses_work(model_dir):
    eng = create_engine("hf", model_dir, max_model_len=64)
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        eng.generate([PROMPTS[0]], SamplingConfig(max_new_tokens=2))


@pytest.mark.integration
def test_empty_requests(hf):
    assert hf.generate([], SamplingConfig(max_new_tokens=2)) == []
    assert hf.generate_branches([[1, 2, 3]], [[]], SamplingConfig(max_new_tokens=2)) == [[]]


# ---- vllm engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_engine(model_dir):
    pytest.importorskip("vllm")
    psutil = pytest.importorskip("psutil")
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. a verifier's forkserver
    eng = create_engine("vllm", model_dir, max_model_len=MAX_LEN, max_prompt_len=64, seed=0)
    yield eng
    eng.close()
    assert eng.closed
    assert engine_processes_left(before) == []  # no engine process left spinning


def weight_files() -> set[str]:
    """Weight files of this process tree or of a dead writer (`tests.helpers.written_here_or_orphaned`)."""
    import glob
    import tempfile

    from tests.helpers import written_here_or_orphaned

    return written_here_or_orphaned({f for d in ("/dev/shm", tempfile.gettempdir())
                                     for f in glob.glob(f"{d}/anytime-weights-*")})


def engine_processes_left(before: set[int]) -> list[list[str]]:
    """Command lines of child processes started since ``before`` that are still alive (zombies count
    as gone), leaving out multiprocessing's resource tracker: it lives as long as this process, by design."""
    import psutil

    def command(p: psutil.Process) -> list[str] | None:
        try:
            return None if p.status() == psutil.STATUS_ZOMBIE else p.cmdline()
        except psutil.Error:  # exited meanwhile
            return None

    new = [p for p in psutil.Process().children(recursive=True)
           if p.pid not in before and "resource_tracker" not in " ".join(command(p) or [])]
    psutil.wait_procs(new, timeout=30)
    return [c for c in map(command, new) if c is not None]


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_greedy_matches_hf(vllm_engine, hf):
    params = SamplingConfig(max_new_tokens=30, temperature=0, n=2)
    v, h = vllm_engine.generate(PROMPTS, params), hf.generate(PROMPTS, params)
    for vs, hs in zip(v, h):
        assert len(vs) == 2
        for vc, hc in zip(vs, hs):
            assert vc.token_ids == hc.token_ids
            assert vc.finish_reason == hc.finish_reason == "length"
            assert_close_logprobs(vc.logprobs, hc.logprobs, 1e-3)


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_branches_match_hf(vllm_engine, hf):
    prefixes, branches = make_prefixes(hf)
    params = SamplingConfig(max_new_tokens=12, temperature=0)
    v = vllm_engine.generate_branches(prefixes, branches, params)
    h = hf.generate_branches(prefixes, branches, params)
    for i in range(len(prefixes)):
        for j in range(len(branches[i])):
            assert v[i][j][0].token_ids == h[i][j][0].token_ids, (i, j)
            assert_close_logprobs(v[i][j][0].logprobs, h[i][j][0].logprobs, 1e-3)


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_seeded_sampling_stops_and_raw_logprobs(vllm_engine, hf):
    stop = tuple(range(0, 512, 3))
    params = SamplingConfig(max_new_tokens=40, n=3, temperature=1.5, stop_token_ids=stop, seed=5)
    first = vllm_engine.generate(PROMPTS, params)
    assert first == vllm_engine.generate(PROMPTS, params)
    assert first != vllm_engine.generate(
        PROMPTS, SamplingConfig(max_new_tokens=40, n=3, temperature=1.5, stop_token_ids=stop, seed=6)
    )
    samples = [c for per_prompt in first for c in per_prompt]
    assert any(c.finish_reason == "stop" for c in samples)
    for c in samples:
        hits = [i for i, t in enumerate(c.token_ids) if t in stop]
        assert hits == ([len(c.token_ids) - 1] if c.finish_reason == "stop" else [])
    # vLLM's raw logprobs equal the hf model's (temperature-free) logprobs of the same tokens
    for prompt, per_prompt in zip(PROMPTS, first):
        for c in per_prompt:
            assert_close_logprobs(c.logprobs, reference_logprobs(hf.model, prompt, c.token_ids), 1e-3)


# Natural-length traces: with 4 stop ids the tiny model's 9 traces end after 19 to 76 tokens at
# temperature 1 (3 reach the cap of 96), so traces end at different engine steps.
NATURAL = SamplingConfig(max_new_tokens=96, n=3, temperature=1.0, stop_token_ids=(0, 131, 262, 393), seed=5)
SUMMARY = SamplingConfig(max_new_tokens=10, n=2, temperature=1.0, seed=9)


def anytime_plan(prompts, n, calls=None):
    """Cut every trace at 16/48/96 tokens, like the anytime rollout: a forced close where a budget
    really cuts, the header alone on budgets past the trace's end. Records when each call came."""
    import time

    def plan(k, trace):
        if calls is not None:
            calls.append(time.perf_counter())
        offset, length = len(prompts[k // n]), len(trace.token_ids)
        return [Branch(offset + min(b, length), (CLOSE, 7) if b < length else (7,)) for b in (16, 48, 96)]

    return plan


def assert_same_samples(a, b):
    """Token-for-token equal samples (and equal finish reasons), log-probs equal to float noise."""
    flat = [(x, y) for pa, pb in zip(a.traces, b.traces) for x, y in zip(pa, pb)]
    flat += [(x, y) for ta, tb in zip(a.summaries, b.summaries) for ba, bb in zip(ta, tb) for x, y in zip(ba, bb)]
    assert len(flat) == sum(map(len, a.traces)) + sum(len(s) for t in a.summaries for s in t)
    for x, y in flat:
        assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
        assert_close_logprobs(x.logprobs, y.logprobs, 1e-5)


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_streamed_summaries_sample_what_two_phases_sample(vllm_engine):
    """Streamed summaries (queued as each trace ends) give every trace and summary of the phased
    path, token for token, for the same seeds; and they really start before the last trace ends."""
    import time

    timed = {}
    for stream in (False, True):
        vllm_engine.stream_summaries, calls = stream, []
        start = time.perf_counter()
        out = vllm_engine.generate_anytime(PROMPTS, NATURAL, anytime_plan(PROMPTS, 3, calls), SUMMARY)
        timed[stream] = (out, [t - start for t in calls])
    vllm_engine.stream_summaries = True
    (phased, phased_calls), (streamed, streamed_calls) = timed[False], timed[True]
    assert_same_samples(phased, streamed)
    lengths = [len(c.token_ids) for per in streamed.traces for c in per]
    assert len(set(lengths)) >= 5 and {c.finish_reason for per in streamed.traces for c in per} == {"stop", "length"}
    assert all(len(branch) == 2 for trace in streamed.summaries for branch in trace) and len(streamed.summaries) == 9
    assert min(phased_calls) >= phased.thinking_s  # two phases: planned after the thinking
    assert min(streamed_calls) < streamed.thinking_s  # streamed: the first trace's summaries start early
    assert 0 < streamed.thinking_s <= streamed.total_s


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_streamed_plan_errors_leave_the_engine_clean(vllm_engine):
    greedy = SamplingConfig(max_new_tokens=12, temperature=0)
    before = vllm_engine.generate(PROMPTS, greedy)
    outside = lambda k, trace: [Branch(len(PROMPTS[k // 3]) + len(trace.token_ids) + 1, (CLOSE,))]  # noqa: E731
    with pytest.raises(ValueError, match="outside prefix"):
        vllm_engine.generate_anytime(PROMPTS, NATURAL, outside, SUMMARY)
    uneven = lambda k, trace: [Branch(1, (CLOSE,))] * (1 + k % 2)  # noqa: E731
    with pytest.raises(ValueError, match="same number of branches"):
        vllm_engine.generate_anytime(PROMPTS, NATURAL, uneven, SUMMARY)
    assert vllm_engine.generate(PROMPTS, greedy) == before  # nothing left over in the engine


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_update_weights_matches_learner(vllm_engine, model_dir):
    new = perturbed_copy(model_dir)
    params = SamplingConfig(max_new_tokens=25, temperature=0)
    before = vllm_engine.generate(PROMPTS, params)  # also fills the prefix cache with old-weight KV
    with pytest.raises(ValueError, match="names the model does not have"):
        vllm_engine.update_weights([("model.norm.weight_typo", torch.ones(128))])
    assert vllm_engine.generate(PROMPTS, params) == before
    vllm_engine.update_weights(new.named_parameters())
    after = vllm_engine.generate(PROMPTS, params)
    for prompt, b, a in zip(PROMPTS, before, after):
        assert a[0].token_ids != b[0].token_ids
        assert a[0].token_ids == reference_greedy(new, prompt, 25)[0]
    # and back: the engine serves the original weights again (other tests share this engine)
    vllm_engine.update_weights(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    assert vllm_engine.generate(PROMPTS, params) == before


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_bad_requests_fail_before_generation(vllm_engine):
    ok = SamplingConfig(max_new_tokens=8)
    with pytest.raises(ValueError, match="max_prompt_len=64"):
        vllm_engine.generate([PROMPTS[0], list(range(5, 75))], ok)
    with pytest.raises(ValueError, match="max_model_len=256"):
        vllm_engine.generate([PROMPTS[0]], SamplingConfig(max_new_tokens=250))
    with pytest.raises(ValueError, match="outside prefix"):
        vllm_engine.generate_branches([[1, 2, 3]], [[Branch(4, (CLOSE,))]], ok)


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_sleep_is_a_logged_noop_on_cpu(vllm_engine, caplog):
    if not vllm_engine.on_cpu:
        pytest.skip("GPU engine: sleep mode is real there")
    with caplog.at_level(logging.INFO, logger="anytime.rollout.engines.vllm.engine"):
        vllm_engine.sleep()
        vllm_engine.wake_up()
    assert sum("no-op" in r.getMessage() for r in caplog.records) == 2
    out = vllm_engine.generate([PROMPTS[0]], SamplingConfig(max_new_tokens=3, temperature=0))
    assert len(out[0][0].token_ids) == 3


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_rejects_unservable_head_dim(tmp_path):
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("head-dim limits checked here are those of vLLM's CPU attention")
    path = build_tiny_model(tmp_path, CORPUS[:50], hidden_size=64, num_heads=4, num_kv_heads=1)  # head_dim 16
    with pytest.raises(ValueError, match="head_dim=16"):
        create_engine("vllm", str(path), max_model_len=64)


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_engine_in_its_own_process(model_dir, learner, vllm_engine):
    """The layout used inside a multi-process learner: the engine runs in its own process, samples
    exactly what the in-process engine samples, takes weights through vLLM's weight-transfer calls (the
    CPU twin of CUDA IPC: a shared-memory file, deleted once the engine has loaded it), and closing leaves
    no process behind (AsyncLLM's, always in a process of its own: tests/rollout/test_vllm_inflight.py and
    tests/rollout/test_vllm_inflight.py::test_async_frontend_swaps_while_the_engine_runs_and_keeps_the_traces_kv)."""

    pytest.importorskip("vllm")
    psutil = pytest.importorskip("psutil")
    import tempfile

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    sockets_before = {p for p in Path(tempfile.gettempdir()).iterdir() if p.is_socket()}
    eng = create_engine("vllm", model_dir, max_model_len=MAX_LEN, max_prompt_len=64, own_process=True)
    ipc_dir = Path(eng._ipc_dir)
    try:
        assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        assert any(p.is_socket() for p in ipc_dir.iterdir())   # vLLM's sockets went to the engine's folder
        greedy = SamplingConfig(max_new_tokens=20, temperature=0)
        assert [c[0].token_ids for c in eng.generate(PROMPTS, greedy)] == [
            reference_greedy(learner, p, 20)[0] for p in PROMPTS
        ]
        sampled = SamplingConfig(max_new_tokens=20, n=2, temperature=1.5, seed=5)
        first = eng.generate(PROMPTS, sampled)
        assert first == eng.generate(PROMPTS, sampled) == vllm_engine.generate(PROMPTS, sampled)
        assert first != eng.generate(PROMPTS, SamplingConfig(max_new_tokens=20, n=2, temperature=1.5, seed=6))
        plan = anytime_plan(PROMPTS, 3)  # streamed: the engine is a client of its own process's core
        assert_same_samples(eng.generate_anytime(PROMPTS, NATURAL, plan, SUMMARY),
                            vllm_engine.generate_anytime(PROMPTS, NATURAL, plan, SUMMARY))
        new = perturbed_copy(model_dir)
        files_before, calls = weight_files(), recorded(eng)
        eng.update_weights(new.state_dict().items())
        assert weight_files() == files_before
        assert [m for m, _ in calls] == [*TRANSFER, "reset_prefix_cache"] and calls[2][1] == [None]
        assert [c[0].token_ids for c in eng.generate(PROMPTS, greedy)] == [
            reference_greedy(new, p, 20)[0] for p in PROMPTS
        ]
    finally:
        eng.close()
    assert engine_processes_left(before) == []
    assert not ipc_dir.exists()
    assert {p for p in Path(tempfile.gettempdir()).iterdir() if p.is_socket()} <= sockets_before


@pytest.mark.integration
def test_orphaned_weight_files_are_removed(tmp_path):
    pytest.importorskip("psutil")
    from anytime.rollout.engines.weight_files import remove_orphaned_weight_files

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"anytime-weights-{int(dead.stdout)}-x.safetensors"
    live = tmp_path / f"anytime-weights-{os.getpid()}-y.safetensors"
    other = tmp_path / "unrelated.safetensors"
    for f in (orphan, live, other):
        f.write_bytes(b"0")
    remove_orphaned_weight_files([str(tmp_path)])
    assert not orphan.exists() and live.exists() and other.exists()


@pytest.mark.integration
def test_weights_file_keeps_tied_and_sliced_tensors():
    from safetensors.torch import load_file

    from anytime.rollout.engines.weight_files import write_weights

    emb, fused = torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(6, 2)
    path = write_weights([("model.embed_tokens.weight", emb), ("lm_head.weight", emb), ("b", torch.ones(3)),
                           ("q", fused[:3]), ("k", fused[3:])])
    try:
        back = load_file(path)
    finally:
        os.unlink(path)
    assert torch.equal(back["lm_head.weight"], emb) and torch.equal(back["model.embed_tokens.weight"], emb)
    assert back["lm_head.weight"].dtype == torch.bfloat16 and torch.equal(back["b"], torch.ones(3))
    assert torch.equal(back["q"], fused[:3]) and torch.equal(back["k"], fused[3:])
