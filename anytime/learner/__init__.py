"""Policy learners behind one interface (`base.Learner`): plain PyTorch data parallel
(`data_parallel`), DeepSpeed ZeRO (`deepspeed_learner`), the zero-bubble pipeline
(`pipeline_learner`, `deepspeed_pipeline` and `deepspeed_stage`) and their device mesh (`mesh`);
the one PPO loop (`ppo`), checkpoints (`checkpoint`) and their export to Hugging Face folders
(`export`). `factory.build_learner` builds the one a recipe names from the registries below.
"""

from anytime.registry import Registry

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
