"""Prompt sets: training rows from the hub, local files or the synthetic task (`prompts`) and the
benchmark registry of `eval/benchmarks.yaml` (`benchmarks`)."""
