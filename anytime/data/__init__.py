"""Prompt sets: training rows from the hub, local files or the synthetic task (`prompts`), the splits
of a procedural task (`task_splits`), the benchmark registry of `anytime/data/benchmarks.yaml` (`benchmarks`),
and the one dispatcher that tells these sources apart, with a recipe's training rows (`sources`)."""
