"""The zero-bubble pipeline-parallel backbone: schedules as data (`schedule` and the generators
`schedules_1f1b`, `schedules_zb`, `schedules_v`, `auto`) and the runtime that executes them on
torch.distributed (`runtime`, `splitgrad`, `offload`, `postvalidate`, `partition`, `causal_lm`).
Their simulator, plots and `anytime schedule` live in `anytime.analysis`, which no training run imports.
"""

from anytime.registry import Registry

SCHEDULES = Registry("learner.pipeline.schedule", {
    "1f1b": "anytime.pipeline.schedules_1f1b:ONE_F_ONE_B",
    "interleaved-1f1b": "anytime.pipeline.schedules_1f1b:INTERLEAVED_1F1B",
    "zb-h1": "anytime.pipeline.schedules_zb:ZB_H1",
    "zb-h2": "anytime.pipeline.schedules_zb:ZB_H2",
    "zb-v": "anytime.pipeline.schedules_v:ZB_V",
    "v-half": "anytime.pipeline.schedules_v:V_HALF",
    "v-min": "anytime.pipeline.schedules_v:V_MIN",
    "zb-auto": "anytime.pipeline.auto:ZB_AUTO",
}, doc="the pipeline schedule of the learner")
