"""Rollout: engines that sample thinking traces and prefix-shared summaries (`engine`, with
`hf` and `vllm`), the anytime rollout on one engine (`runner`, `settings`, `seeding`), the rollout
worker that turns prompts into a `TrainBatch` (`worker`), and where workers run (`placement`,
`local`, `processes`, `ray_workers`). The rollout imports the data contract (`anytime.batch`), never the learner.
"""

from anytime.registry import Registry

ENGINES = Registry("rollout.engine", {
    "hf": "anytime.rollout.hf:HFEngine",
    "vllm": "anytime.rollout.vllm:VLLMEngine",
}, doc="the generator of thinking traces and summaries")

PLACEMENTS = Registry("rollout.placement", {
    "inprocess": "anytime.rollout.local:InProcessRollouts",
    "colocated": "anytime.rollout.local:ColocatedRollouts",
    "ray": "anytime.rollout.ray_workers:RayRollouts",
    "processes": "anytime.rollout.processes:ProcessRollouts",
}, doc="where rollout workers run (`auto`: inprocess with one learner process, else colocated)")
