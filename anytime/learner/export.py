"""Export a training checkpoint as a Hugging Face model folder.

`anytime export CKPT --out DIR [--force]` writes safetensors weights, config, tokenizer (with its
chat template) and a generation config that `AutoModelForCausalLM.from_pretrained` and vLLM load.
CKPT may be a learner checkpoint (`step_N/`, whose `model/` holds the full weights), a DeepSpeed
ZeRO checkpoint folder (shards are consolidated with DeepSpeed's own zero_to_fp32, stage by stage
for a pipeline mesh), or a plain
Hugging Face folder. Afterwards the learner's weights and the exported folder are compared on a
fixed batch and the max abs log-prob difference is printed.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch

from anytime import defaults


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a step_N checkpoint folder, a DeepSpeed checkpoint or a HF folder")
    parser.add_argument("--out", required=True, help="output folder (must be empty unless --force)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    parser.add_argument("--dtype", default=None, choices=defaults.DTYPES.names(),
                        help="cast the weights (default: keep the checkpoint's dtype)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="max abs log-prob difference allowed")


def _hf_folder(ckpt: Path) -> Path:
    for cand in (ckpt / "model", ckpt):
        if (cand / "config.json").is_file():
            return cand
    raise FileNotFoundError(f"{ckpt} holds no Hugging Face config.json (looked in {ckpt / 'model'} and {ckpt})")


def learner_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The learner's weights as saved: DeepSpeed shards when present (consolidated), else safetensors."""
    ds_dir = ckpt / "deepspeed"
    if ds_dir.is_dir() and any(ds_dir.glob("*optim_states.pt")) and any(ds_dir.glob("zero_pp_rank_*")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        from anytime.learner.checkpoint import check_deepspeed_files
        from anytime.learner.deepspeed_stage import consolidate_checkpoint, mesh_stage_files

        check_deepspeed_files(ds_dir)  # DeepSpeed's reader unpickles: refuse files that would run code
        if len(mesh_stage_files(ds_dir)) > 1:  # a pipeline mesh: one model-parallel rank per stage
            return consolidate_checkpoint(ds_dir)
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="deepspeed")
    from safetensors.torch import load_file

    folder = _hf_folder(ckpt)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _fixed_batch(tokenizer: Any, vocab: int) -> torch.Tensor:
    texts = ["Start with 3. Add 4, add 5. What is the last digit of the result?",
             defaults.INSTRUCTION]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:32] for t in texts]
    n = min(len(x) for x in ids)
    batch = torch.tensor([x[:n] for x in ids])
    return batch.clamp_(0, vocab - 1)


@torch.no_grad()
def logprob_parity(model_a: torch.nn.Module, model_b: torch.nn.Module, batch: torch.Tensor) -> float:
    from anytime.algo.logprobs import token_logprobs

    la = token_logprobs(model_a(batch).logits[:, :-1].double(), batch[:, 1:])
    lb = token_logprobs(model_b(batch).logits[:, :-1].double(), batch[:, 1:])
    return float((la - lb).abs().max())


def export_checkpoint(ckpt: str | Path, out: str | Path, *, force: bool = False, dtype: str | None = None) -> tuple[Path, float]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    ckpt, out = Path(ckpt), Path(out)
    if not ckpt.exists():
        raise FileNotFoundError(f"checkpoint {str(ckpt)!r} does not exist")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {str(out)!r} is not empty; choose an empty folder or pass --force")
    src = _hf_folder(ckpt)
    config = AutoConfig.from_pretrained(src)
    state = learner_state_dict(ckpt)
    learner = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = learner.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if [k for k in missing if "lm_head" not in k] or unexpected:
        raise ValueError(f"checkpoint weights do not match the model config: missing {missing}, unexpected {unexpected}")
    learner.tie_weights()
    learner.eval()
    tmp = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    target = learner if dtype is None else AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if dtype is not None:
        target.load_state_dict(learner.state_dict())
    target.save_pretrained(tmp, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(src)
    tokenizer.save_pretrained(tmp)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos,
                     pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
                     ).save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    diff = logprob_parity(learner, reloaded, _fixed_batch(tokenizer, config.vocab_size))
    return out, diff


def run(args: argparse.Namespace) -> int:
    out, diff = export_checkpoint(args.checkpoint, args.out, force=args.force, dtype=args.dtype)
    print(f"exported {args.checkpoint} -> {out}")
    print(f"logprob_parity_max_abs_diff: {diff:.3e}")
    if args.dtype is None and diff > args.tolerance:
        print(f"error: exported model differs from the learner's by {diff:.3e} > {args.tolerance}")
        return 1
    return 0
