"""Pure GRPO algorithm core: advantages, policy loss and aggregation, KL estimators, logprobs, rewards.

Plain PyTorch on tensors; imports neither Ray nor `torch.distributed`, so everything here runs and is tested in
one process. Notation: B prompts, G completions per prompt (a group), N = B·G sequences, T response tokens, V vocab.
"""

from grpo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimatorName,
    GroupStats,
    StdKind,
    all_equal_fraction,
    compute_advantages,
    compute_group_stats,
    group_all_equal_mask,
    register_advantage_estimator,
)
from grpo.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    KLEstimatorName,
    kl_penalty,
    register_kl_estimator,
)
from grpo.logprobs import entropy_from_logits, logprobs_from_logits
from grpo.losses import (
    LOSS_AGGREGATIONS,
    LossAggregationName,
    aggregate_loss,
    policy_loss,
    register_loss_aggregation,
)
from grpo.registry import Registry
from grpo.rewards import (
    REWARD_FUNCTIONS,
    CombinedRewards,
    RewardFunctionName,
    combine_rewards,
    register_reward_function,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "REWARD_FUNCTIONS",
    "AdaptiveKLController",
    "AdvantageEstimatorName",
    "CombinedRewards",
    "FixedKLController",
    "GroupStats",
    "KLController",
    "KLEstimatorName",
    "LossAggregationName",
    "Registry",
    "RewardFunctionName",
    "StdKind",
    "aggregate_loss",
    "all_equal_fraction",
    "combine_rewards",
    "compute_advantages",
    "compute_group_stats",
    "entropy_from_logits",
    "group_all_equal_mask",
    "kl_penalty",
    "logprobs_from_logits",
    "policy_loss",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_loss_aggregation",
    "register_reward_function",
]
