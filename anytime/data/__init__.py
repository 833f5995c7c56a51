"""Prompt sets: training rows from the hub, local files or the synthetic task (`prompts`), the splits
of a procedural task (`task_splits`) and the benchmark registry of `anytime/data/benchmarks.yaml` (`benchmarks`)."""
