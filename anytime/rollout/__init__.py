"""Rollout: engines that sample thinking traces and prefix-shared summaries (`engine`, with
`hf` and `vllm`), the anytime rollout on one engine (`runner`, `settings`, `seeding`), the rollout
worker that turns prompts into a `TrainBatch` (`worker`), and where workers run (`placement`,
`local`, `processes`, `ray_workers`), registered in `anytime.components`. The rollout imports the
data contract (`anytime.batch`), never the learner.
"""
