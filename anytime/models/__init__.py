"""Model-side helpers: loading a causal LM (`loading`), the tree-packed attention inputs (`attention`)
and the offline SmolLM2 conversion (`smollm`)."""
