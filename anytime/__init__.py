"""anytime: RL fine-tuning for anytime reasoning (AnytimeReasoner / BRPO)."""

__version__ = "0.1.0"
