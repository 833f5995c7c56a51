"""Rollout: the anytime rollout on one engine (`runner`: thinking traces, cuts, summaries, verified
scores; `settings`, `seeding`), the engines behind it (`engines`: transformers and vLLM), and the workers
that run it where the placement plan puts them (`workers`), registered in `anytime.components`. The
rollout imports the data contract (`anytime.batch`), never the learner, the trainer or serving.
"""
