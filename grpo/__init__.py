"""Pure GRPO algorithm core: advantages, policy loss and aggregation, KL estimators, logprobs, rewards, held-out
accuracy statistics (`grpo.stats`), the reward-hacking monitor (`grpo.monitor`) and the off-policy correction
(`grpo.off_policy`: truncated and masked importance sampling against the engine's logprobs, and their metrics).

Plain PyTorch on tensors; imports neither Ray nor `torch.distributed`, so everything here runs and is tested in
one process. It imports no other package of this project (``cluster``, workers, ``weight_sync``, ...): they import it
(``tests/unit/test_import_layering.py``). Notation: B prompts, G completions per prompt (a group), N = B·G sequences,
T response tokens, V vocab.
"""

from grpo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimatorName,
    GroupStats,
    RewardCombineName,
    StdKind,
    all_equal_fraction,
    compute_advantages,
    compute_group_stats,
    compute_multi_reward_advantages,
    group_all_equal_mask,
    register_advantage_estimator,
)
from grpo.eos import eos_token_ids, response_valid_lengths
from grpo.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    KLEstimatorName,
    kl_penalty,
    kl_reward_advantages,
    make_kl_controller,
    register_kl_estimator,
)
from grpo.logprobs import entropy_from_logits, logprobs_from_logits
from grpo.losses import (
    LOSS_AGGREGATIONS,
    LossAggregationName,
    aggregate_loss,
    policy_loss,
    register_loss_aggregation,
    truncated_importance_weights,
)
from grpo.off_policy import (
    MIS_LEVELS,
    TIS_LEVELS,
    OffPolicyLevel,
    behaviour_kl_k3,
    check_mis_band,
    importance_log_ratio,
    importance_weights,
    masked_fraction,
    mis_keep_mask,
    ratio_quantiles,
    register_mis_level,
    register_tis_level,
    sequence_log_ratio,
    staleness_histogram,
)
from grpo.monitor import DETECTORS, DetectorName, Monitor, MonitorConfig, Trip
from grpo.policy_losses import POLICY_LOSSES, PolicyLossName, register_policy_loss
from grpo.registry import Registry
from grpo.rewards import (
    REWARD_FUNCTIONS,
    CombinedRewards,
    RewardFunctionName,
    combine_rewards,
    overlong_penalty,
    register_reward_function,
)
from grpo.stats import AccuracyEstimate, accuracy_estimate, mean_at_k, pass_at_1, pass_at_k, wilson_interval

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DETECTORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "MIS_LEVELS",
    "POLICY_LOSSES",
    "REWARD_FUNCTIONS",
    "TIS_LEVELS",
    "AccuracyEstimate",
    "AdaptiveKLController",
    "AdvantageEstimatorName",
    "CombinedRewards",
    "DetectorName",
    "FixedKLController",
    "GroupStats",
    "KLController",
    "KLEstimatorName",
    "LossAggregationName",
    "Monitor",
    "MonitorConfig",
    "OffPolicyLevel",
    "PolicyLossName",
    "Registry",
    "RewardCombineName",
    "RewardFunctionName",
    "StdKind",
    "Trip",
    "accuracy_estimate",
    "aggregate_loss",
    "all_equal_fraction",
    "behaviour_kl_k3",
    "check_mis_band",
    "combine_rewards",
    "compute_advantages",
    "compute_group_stats",
    "compute_multi_reward_advantages",
    "entropy_from_logits",
    "eos_token_ids",
    "group_all_equal_mask",
    "importance_log_ratio",
    "importance_weights",
    "kl_penalty",
    "kl_reward_advantages",
    "make_kl_controller",
    "logprobs_from_logits",
    "masked_fraction",
    "mean_at_k",
    "mis_keep_mask",
    "overlong_penalty",
    "pass_at_1",
    "pass_at_k",
    "policy_loss",
    "ratio_quantiles",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_loss_aggregation",
    "register_mis_level",
    "register_policy_loss",
    "register_reward_function",
    "register_tis_level",
    "response_valid_lengths",
    "sequence_log_ratio",
    "staleness_histogram",
    "truncated_importance_weights",
    "wilson_interval",
]
