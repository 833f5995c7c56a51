"""Scoring across thinking budgets: `anytime eval` (`evaluate`), its options (`options`), per-sample
records and their aggregation (`records`), and the trainer's held-out eval on a rollout worker
(`in_training`)."""
