"""No float the spec accepts overflows float32 in the train step: every float field is either bounded (at most
``MAX_RATIO`` = e^20 for a ratio bound, ``MAX_COEFFICIENT`` = 1e6 for a coefficient, or a tighter bound) or listed in
:data:`NO_TENSOR` with the reason it never reaches a tensor; 1e39 is refused at validation naming the field; and the
policy loss at the largest accepted settings, with every ratio at its clamp, is finite in value and gradient."""

from __future__ import annotations

import math
import typing
from typing import get_args

import pytest
import torch
from annotated_types import Le, Lt
from pydantic import BaseModel

from cluster.spec import JobSpec, SpecError, load_spec_text
from cluster.spec.fields import MAX_COEFFICIENT, MAX_RATIO
from grpo.advantages import compute_advantages
from grpo.losses import LossAggregationName, policy_loss
from grpo.off_policy import importance_weights, mis_keep_mask
from grpo.policy_losses import LOG_RATIO_CLAMP, PolicyLossName, supports_dual_clip

MINIMAL = "output_dir: o\ntotal_steps: 1\ndata: {train_path: x}\n"
#: Float fields with no float32 bound, and why none is needed: they never reach a tensor of the train step.
NO_TENSOR = {
    "rollout.num_cpus_per_replica": "a Ray resource amount",
    "rollout.num_gpus_per_replica": "a Ray resource amount",
    "rollout.kv_cache_gib": "the engines' KV-cache size, checked against the machine's memory",
    "rollout.resources": "Ray resource amounts, bounded by check_custom_resources",
    "train.num_cpus_per_worker": "a Ray resource amount",
    "train.num_gpus_per_worker": "a Ray resource amount",
    "train.resources": "Ray resource amounts, bounded by check_custom_resources",
    "reward_pool.num_cpus_per_worker": "a Ray resource amount",
    "reward_pool.resources": "Ray resource amounts, bounded by check_custom_resources",
    "rollout.agent_pool.resources": "Ray resource amounts, bounded by check_custom_resources",
    "data.reasoning_gym.config": "a reasoning-gym task generator's settings, checked by reasoning-gym",
    "algorithm.kl_target": "compared with the measured KL in Python (the adaptive controller), never a tensor",
}
#: Float fields bounded by a validator rather than a field bound, and a value beyond it the validator refuses naming
#: the field (1e39, or for the MIS band's low end any value >= 1: it must be below 1 < high <= e^20).
VALIDATED = {"algorithm.rewards": "algorithm.rewards={accuracy: 1e39}", "train.betas": "train.betas=[1e39, 0.9]",
             "algorithm.mis.low": "algorithm.mis={level: token, low: 1.5, high: 2}"}


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models(arg)]


def _holds_float(annotation) -> bool:
    if annotation is float:
        return True
    return any(_holds_float(arg) for arg in get_args(annotation) if arg is not typing.Any)


def float_fields(model: type[BaseModel] = JobSpec, prefix: str = "") -> dict[str, float | None]:
    """{dotted field: its upper bound (le/lt), None when it has none} for every field holding a float."""
    out = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if _holds_float(field.annotation):
            bounds = [m.le for m in field.metadata if isinstance(m, Le)] + [m.lt for m in field.metadata
                                                                            if isinstance(m, Lt)]
            out[path] = min(bounds) if bounds else None
        for nested in _models(field.annotation):
            out.update(float_fields(nested, f"{path}."))
    return out


def test_the_ratio_bound_is_the_train_steps_clamp():
    assert MAX_RATIO == math.exp(LOG_RATIO_CLAMP)


def test_every_float_field_is_bounded_or_never_reaches_a_tensor():
    fields = float_fields()
    assert {"algorithm.tis_cap", "algorithm.clip_eps_high", "algorithm.kl_coef", "train.lr",
            "train.lora.alpha", "algorithm.mis.high"} <= set(fields)  # the walk reaches nested models
    unbounded = sorted(f for f, bound in fields.items() if bound is None and f not in NO_TENSOR and f not in VALIDATED)
    assert unbounded == [], f"float fields without a float32-safe bound: {unbounded}"
    too_high = {f: b for f, b in fields.items() if b is not None and b > MAX_RATIO}
    assert too_high == {}, too_high
    assert set(NO_TENSOR) <= set(fields) and set(VALIDATED) <= set(fields)  # the lists name real fields


@pytest.mark.parametrize("override, field", [
    ("algorithm.tis_cap=1e39", "algorithm.tis_cap"),
    ("algorithm.clip_eps_high=1e39", "algorithm.clip_eps_high"),
    ("algorithm.dual_clip_c=1e39", "algorithm.dual_clip_c"),
    ("algorithm.entropy_coef=1e39", "algorithm.entropy_coef"),
    ("algorithm.kl_coef=1e39", "algorithm.kl_coef"),
    ("algorithm.adv_eps=1e39", "algorithm.adv_eps"),
    ("algorithm.overlong_penalty_factor=1e39", "algorithm.overlong_penalty_factor"),
    ("algorithm.mis={level: token, low: 0.5, high: 1e39}", "algorithm.mis.high"),
    ("algorithm.mis={level: token, low: 1e-39, high: 2}", "algorithm.mis.low"),
    ("train.lr=1e39", "train.lr"),
    ("train.weight_decay=1e39", "train.weight_decay"),
    ("train.max_grad_norm=1e39", "train.max_grad_norm"),
    ("train.lora={rank: 4, alpha: 1e39}", "train.lora.alpha"),
    *((override, field) for field, override in VALIDATED.items()),
])
def test_a_value_beyond_float32_is_refused_naming_the_field(override, field):
    with pytest.raises(SpecError, match=rf"(: |--set ){field.replace('.', r'[.]')}: "):
        load_spec_text(MINIMAL, source="job.yaml", overrides=[override])


def test_weight_decay_that_would_flip_the_weights_is_refused():
    with pytest.raises(SpecError, match=r"train\.weight_decay: AdamW multiplies the weights by 1 - lr·weight_decay"):
        load_spec_text(MINIMAL, source="job.yaml", overrides=["train.lr=0.5", "train.weight_decay=2"])


@pytest.mark.parametrize("agg", list(get_args(LossAggregationName)))
@pytest.mark.parametrize("mode", list(get_args(PolicyLossName)))
def test_the_loss_at_the_largest_accepted_settings_is_finite(mode, agg):
    """Ratios at e^±20 (current vs proximal and proximal vs engine), the KL estimate at the clamp, every bound at
    its accepted maximum (clip_eps_high, dual_clip_c, tis_cap, kl_coef, entropy_coef): loss and gradient finite."""
    g = torch.Generator().manual_seed(0)
    n, t = 4, 6
    mask = torch.ones(n, t, dtype=torch.bool)
    logp = (-torch.rand(n, t, generator=g) * 2).requires_grad_()
    old = logp.detach() + torch.tensor([30.0, -30.0, 0.5, -0.5])[:, None]  # ratios e^-20 and e^+20 (clamped)
    engine = old - 40.0
    ref = logp.detach() + 40.0
    entropy = (torch.rand(n, t, generator=g) * 12).requires_grad_()
    adv = compute_advantages(torch.tensor([MAX_COEFFICIENT, -MAX_COEFFICIENT, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]),
                             "grpo", eps=MAX_COEFFICIENT)
    tis = importance_weights(old, engine, mask, MAX_RATIO, "sequence")
    assert bool(mis_keep_mask(old, engine, mask, 1 / MAX_RATIO, MAX_RATIO).all())
    loss, metrics = policy_loss(
        logp, old, adv * MAX_COEFFICIENT, mask, clip_eps_low=0.999, clip_eps_high=MAX_RATIO - 1,
        dual_clip_c=MAX_RATIO if supports_dual_clip(mode) else None, loss_agg=agg, ref_logprobs=ref,
        kl_coef=MAX_COEFFICIENT, entropy=entropy, entropy_coef=MAX_COEFFICIENT, tis_weights=tis,
        max_response_tokens=t, loss_mode=mode)
    loss.backward()
    assert math.isfinite(loss.item()) and all(math.isfinite(v.item()) for v in metrics.values())
    assert torch.isfinite(logp.grad).all() and torch.isfinite(entropy.grad).all()
