"""vLLM serves the learner's LoRA adapter itself: every weight version is a new `LoRARequest` (a name
and id never used before, the previous one removed, its folder deleted), and greedy tokens and raw
log-probs match the transformers engine holding the same adapter merged; a LoRA checkpoint exported
merged serves in vLLM with the same greedy tokens."""

from __future__ import annotations

import glob
import tempfile

import pytest
import torch

from anytime.rollout.engines.engine import SamplingConfig, create_engine
from tests.learner.test_lora import _lora_learner
from tests.rollout.test_engines import CORPUS, MAX_LEN, PROMPTS, assert_close_logprobs

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def adapter_folders() -> set[str]:
    return set(glob.glob(f"{tempfile.gettempdir()}/anytime-adapter-*"))


def test_vllm_serves_each_adapter_version_under_a_new_name(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    from anytime.models.tiny import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "tiny", CORPUS, seed=0))
    learner = _lora_learner(model_dir, dtype=torch.float32)
    before = adapter_folders()
    vllm = create_engine("vllm", model_dir, max_model_len=MAX_LEN, max_prompt_len=64, seed=0, max_lora_rank=4)
    hf = create_engine("hf", model_dir, max_model_len=MAX_LEN, max_prompt_len=64)
    try:
        assert vllm.accepts_adapters and vllm.adapter_name is None
        params = SamplingConfig(max_new_tokens=20, temperature=0)
        names = []
        for version in range(3):
            update = learner.adapter_update()
            vllm.update_adapter(update)
            hf.update_adapter(update)
            names.append(vllm.adapter_name)
            assert len(adapter_folders() - before) == 1   # the previous version's folder is gone
            v, h = vllm.generate(PROMPTS, params), hf.generate(PROMPTS, params)
            for (vc,), (hc,) in zip(v, h):
                assert vc.token_ids == hc.token_ids, version
                assert_close_logprobs(vc.logprobs, hc.logprobs, 1e-3)
            with torch.no_grad():   # the next weight version
                for n, p in learner.model.named_parameters():
                    if "lora_B" in n:
                        p.add_(torch.randn_like(p) * 0.5)
        assert len(set(names)) == 3 and names == ["anytime-adapter-v1", "anytime-adapter-v2", "anytime-adapter-v3"]
    finally:
        vllm.close()
    assert adapter_folders() == before
    # a LoRA checkpoint exported merged serves in vLLM with the learner's greedy tokens
    from transformers import AutoTokenizer

    from anytime.learner.checkpoint import save_checkpoint
    from anytime.serving.export import export_checkpoint

    try:
        hf.update_adapter(learner.adapter_update())
        step = save_checkpoint(tmp_path / "ckpt", 1, learner, AutoTokenizer.from_pretrained(model_dir), {}, 1)
        merged, diff = export_checkpoint(step, tmp_path / "merged")
        assert diff <= 1e-5
        served = create_engine("vllm", str(merged), max_model_len=MAX_LEN, max_prompt_len=64, seed=0)
        try:
            v, h = served.generate(PROMPTS, params), hf.generate(PROMPTS, params)
            for (vc,), (hc,) in zip(v, h):
                assert vc.token_ids == hc.token_ids
                assert_close_logprobs(vc.logprobs, hc.logprobs, 1e-3)
        finally:
            served.close()
    finally:
        hf.close()
