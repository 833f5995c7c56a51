"""Registries of the runtime components a recipe names: rollout engines and placements, learners
and learning-rate schedules.

They are declared here, below the recipe schema, and not in `anytime.rollout` / `anytime.learner`
that implement them: the recipe validates these names, and those packages import the recipe, so
declaring them there would make the recipe import upward. Entries are `module:attribute` strings
resolved on first use (`anytime.registry`), so this module imports nothing heavy and no package.
"""

from anytime.registry import Registry

ENGINES = Registry("rollout.engine", {
    "hf": "anytime.rollout.engines.hf:HFEngine",
    "vllm": "anytime.rollout.engines.vllm:vllm_engine",
}, doc="the generator of thinking traces and summaries")

PLACEMENTS = Registry("rollout.placement", {
    "inprocess": "anytime.rollout.workers.local:InProcessRollouts",
    "colocated": "anytime.rollout.workers.local:ColocatedRollouts",
    "ray": "anytime.rollout.workers.ray_workers:RayRollouts",
    "processes": "anytime.rollout.workers.processes:ProcessRollouts",
}, doc="where rollout workers run (`auto`: inprocess with one learner process, else colocated)")

LEARNERS = Registry("learner.backend", {
    "torch": "anytime.learner.data_parallel:TorchLearner",
    "deepspeed": "anytime.learner.deepspeed_learner:DeepSpeedLearner",
}, doc="the learner of a whole model on every rank")

# The same backends on a pipeline (`learner.pipeline.stages` > 1): they build their stages from the
# model path themselves.
PIPELINE_LEARNERS = Registry("learner.backend", {
    "torch": "anytime.learner.pipeline_learner:PipelineLearner",
    "deepspeed": "anytime.learner.deepspeed_pipeline:DeepSpeedPipelineLearner",
}, doc="the learner of a pipelined model")

LR_SCHEDULES = Registry("learner.lr_schedule", {
    "constant": "anytime.learner.lr_schedules:constant",
    "linear": "anytime.learner.lr_schedules:linear",
    "cosine": "anytime.learner.lr_schedules:cosine",
}, doc="the learning-rate multiplier after the warm-up, as a function of progress in [0, 1]")
