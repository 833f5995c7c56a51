"""The method: budget grids, priors and the anytime score (`budget`), advantage estimators
(`advantages`), the PPO-clip loss and its normalisers (`loss`), the off-policy importance weights
of the engine's samples (`offpolicy`), and log-probs through the LM head (`logprobs`).

Everything pluggable here is registered by name below; the recipe's allowed values come from
these registries (`anytime.config`), so a new estimator is its function plus one entry here.
"""

from anytime.registry import Registry

THINKING_ESTIMATORS = Registry("algorithm.estimator", {
    "brpo": "anytime.algo.advantages:brpo_thinking",
    "grpo": "anytime.algo.advantages:grpo_thinking",
    "dr_grpo": "anytime.algo.advantages:dr_grpo_thinking",
    "rloo": "anytime.algo.advantages:rloo_thinking",
}, doc="advantages of the thinking tokens, per budget segment")

SUMMARY_ESTIMATORS = Registry("summary.estimator", {
    "brpo": "anytime.algo.advantages:summary_advantages",
    "grpo": "anytime.algo.advantages:summary_advantages_last_only",
}, doc="advantages of the summaries")

VARIANCE_REDUCTIONS = Registry("algorithm.variance_reduction", {
    "brpo": "anytime.algo.advantages:brpo_baseline",
    "v1only": "anytime.algo.advantages:progress_baseline",
    "v2only": "anytime.algo.advantages:group_baseline",
    "none": "anytime.algo.advantages:no_baseline",
}, doc="BRPO's baseline of the returns-to-go")

BUDGET_PRIORS = Registry("budget.prior", {
    "base": "anytime.algo.budget:base_prior",
    "uniform": "anytime.algo.budget:uniform_prior",
    "linear": "anytime.algo.budget:linear_prior",
    "explicit": "anytime.algo.budget:explicit_prior",
}, doc="the prior P over the budget grid")

LOSS_AGGREGATIONS = Registry("algorithm.loss_agg", {
    "token-mean": "anytime.algo.loss:token_mean",
    "seq-mean-token-mean": "anytime.algo.loss:seq_mean_token_mean",
    "constant": "anytime.algo.loss:constant_norm",
}, doc="how token losses become one scalar")

KL_ESTIMATORS = Registry("algorithm.kl_type", {
    "k1": "anytime.algo.loss:kl_k1",
    "k3": "anytime.algo.loss:kl_k3",
}, doc="per-token estimate of KL(π‖π_ref)")

OFFPOLICY_CORRECTIONS = Registry("algorithm.offpolicy_correction", {
    "none": "anytime.algo.offpolicy:no_correction",
    "tis": "anytime.algo.offpolicy:truncated_weights",
    "mis": "anytime.algo.offpolicy:masked_weights",
}, doc="importance weight π_prox/π_behav of the engine-sampled tokens: off, truncated or masked at the cap")
