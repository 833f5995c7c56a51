"""The data contract between rollout and learner, imported by both (neither imports the other):

- `anytime_rollout.AnytimeRollout`: a rollout's traces, cuts, summaries and verified scores as padded
  tensors [prompt, trace, budget, summary]; `ScoredRollout`: what a rollout worker returns for its
  share of a step (its draws, metric sums and timings);
- `train_batch.TrainBatch` / `MiniBatch`: target-aligned token rows with masks, advantages and
  log-probs, and the mini- and micro-batches the learner steps over;
- `packing.build_train_batch`: the one function that turns the first into the second (a row per
  summary, or tree-packed), called by the trainer's step;
- `weight_snapshot.WeightSnapshot`: the learner's weights on their way back to the engines (full, merged
  or a LoRA adapter, as the placement plan asks), taken by the trainer."""
