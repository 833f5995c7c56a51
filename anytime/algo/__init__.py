"""The method: budget grids, priors and the anytime score (`budget`), advantage estimators
(`advantages`), the PPO-clip loss and its normalisers (`loss`), the off-policy importance weights
of the engine's samples (`offpolicy`), and log-probs through the LM head (`logprobs`).

Each pluggable piece is a registry of the functions themselves, built right after them in the
module that defines them (`advantages.THINKING_ESTIMATORS`, `loss.LOSS_AGGREGATIONS`,
`budget.BUDGET_PRIORS`, ...). The names of those in torch modules are declared here too, so the
recipe schema (`anytime.config`) knows them without importing torch; their module builds its
registry with `Names.implemented_by`, which fails at its import when a name is on one side only.
A new estimator is its function, one entry in its module's registry, and its name below.
"""

from anytime.registry import Names

# implemented in anytime.algo.advantages
THINKING_ESTIMATOR_NAMES = Names("algorithm.estimator", ("brpo", "grpo", "dr_grpo", "rloo"),
                                 doc="advantages of the thinking tokens, per budget segment")
SUMMARY_ESTIMATOR_NAMES = Names("summary.estimator", ("brpo", "grpo"), doc="advantages of the summaries")
VARIANCE_REDUCTION_NAMES = Names("algorithm.variance_reduction", ("brpo", "v1only", "v2only", "none"),
                                 doc="BRPO's baseline of the returns-to-go")

# implemented in anytime.algo.loss
LOSS_AGGREGATION_NAMES = Names("algorithm.loss_agg", ("token-mean", "seq-mean-token-mean", "constant"),
                               doc="how token losses become one scalar")
KL_ESTIMATOR_NAMES = Names("algorithm.kl_type", ("k1", "k3"), doc="per-token estimate of KL(π‖π_ref)")

# implemented in anytime.algo.offpolicy
OFFPOLICY_CORRECTION_NAMES = Names("algorithm.offpolicy_correction", ("none", "tis", "mis"),
                                   doc="importance weight π_prox/π_behav of the engine-sampled tokens: off, "
                                       "truncated or masked at the cap")
