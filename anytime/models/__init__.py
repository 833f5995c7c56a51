"""Model-side helpers: loading a causal LM (`loading`), the tree-packed attention inputs (`attention`),
tiny random chat models for the CPU (`tiny`) and the offline SmolLM2 conversion (`smollm`)."""
