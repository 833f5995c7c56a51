"""Export a training checkpoint as a Hugging Face model folder.

`anytime export CKPT --out DIR [--force]` writes safetensors weights, config, tokenizer (with its
chat template) and a generation config that `AutoModelForCausalLM.from_pretrained` and vLLM load, and
what serving needs (`anytime.serving.model_card`): the answer protocol, the eval's sampling and a model
card.
CKPT may be a learner checkpoint (`step_N/`, whose `model/` holds the full weights), a DeepSpeed
ZeRO checkpoint folder (shards are consolidated with DeepSpeed's own zero_to_fp32, stage by stage
for a pipeline mesh), or a plain
Hugging Face folder. A LoRA checkpoint (`step_N/adapter/`, a PEFT folder) is exported merged into
its base model, or as the PEFT adapter folder itself with `--adapter`. Afterwards the learner's weights and the exported folder are compared on a
fixed batch and the max abs log-prob difference is printed.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from anytime import defaults
from anytime.serving.model_card import write_serving_files

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a step_N checkpoint folder, a DeepSpeed checkpoint or a HF folder")
    parser.add_argument("--out", required=True, help="output folder (must be empty unless --force)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    parser.add_argument("--dtype", default=None, choices=defaults.DTYPES.names(),
                        help="cast the weights (default: keep the checkpoint's dtype)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="max abs log-prob difference allowed")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA checkpoint: write its PEFT adapter folder instead of the merged model")


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
def _logprobs(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    from anytime.algo.logprobs import token_logprobs

    return token_logprobs(model(batch).logits[:, :-1].double(), batch[:, 1:])


def logprob_parity(model_a: torch.nn.Module, model_b: torch.nn.Module, batch: torch.Tensor) -> float:
    return float((_logprobs(model_a, batch) - _logprobs(model_b, batch)).abs().max())


def _adapter_folder(ckpt: Path) -> Path | None:
    """The PEFT adapter folder of a LoRA checkpoint (`step_N/adapter/`, or an adapter folder itself)."""
    from anytime.learner.lora import ADAPTER_DIR

    return next((c for c in (ckpt / ADAPTER_DIR, ckpt) if (c / "adapter_config.json").is_file()), None)


def _save_generation_config(folder: Path, config: Any, tokenizer: Any) -> None:
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos,
                     pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
                     ).save_pretrained(folder)


def load_adapter_model(adapter_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(PeftModel, tokenizer) of a PEFT adapter folder on the base model its config names."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    has_tokenizer = (adapter_dir / "tokenizer_config.json").is_file()
    return PeftModel.from_pretrained(base, adapter_dir).eval(), AutoTokenizer.from_pretrained(
        adapter_dir if has_tokenizer else base_path)


def export_lora(adapter_dir: Path, out: Path, *, adapter: bool, dtype: str | None) -> tuple[Path, float]:
    """A LoRA checkpoint as the merged Hugging Face folder (default), or as its PEFT adapter folder
    (`adapter`); the parity check compares the exported model with the adapter applied unmerged."""
    model, tokenizer = load_adapter_model(adapter_dir)
    batch = _fixed_batch(tokenizer, model.config.vocab_size)
    want = _logprobs(model, batch)
    tmp = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if adapter:
        model.save_pretrained(tmp, safe_serialization=True)
    else:
        merged = model.merge_and_unload()
        if dtype is not None:
            merged = merged.to(getattr(torch, dtype))
        merged.save_pretrained(tmp, safe_serialization=True)
        _save_generation_config(tmp, merged.config, tokenizer)
    tokenizer.save_pretrained(tmp)
    if not adapter:
        write_serving_files(tmp, adapter_dir, tokenizer, name=str(out))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    if adapter:
        reloaded, _ = load_adapter_model(out)
    else:
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return out, float((_logprobs(reloaded, batch) - want).abs().max())


def export_checkpoint(ckpt: str | Path, out: str | Path, *, force: bool = False, dtype: str | None = None,
                      adapter: bool = False) -> tuple[Path, float]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ckpt, out = Path(ckpt), Path(out)
    if not ckpt.exists():
        raise FileNotFoundError(f"checkpoint {str(ckpt)!r} does not exist")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {str(out)!r} is not empty; choose an empty folder or pass --force")
    adapter_dir = _adapter_folder(ckpt)
    if adapter_dir is not None:
        return export_lora(adapter_dir, out, adapter=adapter, dtype=dtype)
    if adapter:
        raise ValueError(f"--adapter needs a LoRA checkpoint (learner.lora.rank > 0): {ckpt} holds no "
                         "adapter/adapter_config.json")
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
    _save_generation_config(tmp, config, tokenizer)
    write_serving_files(tmp, ckpt, tokenizer, name=str(out))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    diff = logprob_parity(learner, reloaded, _fixed_batch(tokenizer, config.vocab_size))
    return out, diff


def serving_folder(path: Path) -> Path:
    """An exported folder as is; a run folder's newest checkpoint exported into RUN/export."""
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if (path / "config.json").is_file():
        return path
    from anytime.learner.checkpoint import list_checkpoints

    steps = list_checkpoints(path / "checkpoints")   # complete ones only, oldest first
    if not steps:
        raise FileNotFoundError(f"{path} is neither a model folder (no config.json) nor a run folder (no complete "
                                "checkpoints/step_N): give the folder `anytime export` wrote")
    out = path / "export"
    stamp = out / ".exported_from"
    if not (stamp.is_file() and stamp.read_text() == steps[-1].name):
        log.info("exporting %s into %s", steps[-1], out)
        export_checkpoint(steps[-1], out, force=True)
        stamp.write_text(steps[-1].name)
    return out


def run(args: argparse.Namespace) -> int:
    out, diff = export_checkpoint(args.checkpoint, args.out, force=args.force, dtype=args.dtype, adapter=args.adapter)
    print(f"exported {args.checkpoint} -> {out}")
    print(f"logprob_parity_max_abs_diff: {diff:.3e}")
    if args.dtype is None and diff > args.tolerance:
        print(f"error: exported model differs from the learner's by {diff:.3e} > {args.tolerance}")
        return 1
    return 0
