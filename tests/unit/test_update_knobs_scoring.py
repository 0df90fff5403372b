"""The ``algorithm.*`` settings that act before the train step move what they document: the advantages and loss masks
of a scored batch (``cluster.loop.scoring.Scoring``, the driver's score stage), and the β the KL controller sets for
the next step (``grpo.kl.make_kl_controller``, as the driver builds it). One table per level, each row a setting, the
context where it must move its output and the contexts where its documentation says it cannot. The train step's own
settings are audited in tests/distributed/test_update_knobs.py; :func:`test_every_setting_is_audited` checks that
every field of ``algorithm``, ``train`` and ``train.lora`` is in one of the tables or in :data:`NOT_THE_UPDATE`.

Contexts (two groups, EOS id 2, ``rollout.max_response_tokens`` 8):

- ``mixed``: accuracy and format vary within each group; one completion cut at the cap, two in the last 4 tokens;
- ``flat``: every completion of a group has the same accuracy and format (no learning signal);
- ``format_flat``: accuracy varies within each group, format is the same within each group;
- ``short``: ``mixed``'s rewards, every completion EOS-terminated within 4 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from cluster.loop.scoring import Scoring
from cluster.spec import AlgorithmSpec, JobSpec, TrainSpec
from cluster.spec.lora import LoraSpec
from contract.messages import GroupResult
from grpo.kl import make_kl_controller
from tests.distributed.test_update_knobs import AUDITED

EOS, CAP = 2, 8
WORK = "She buys 3 packs of 4 pens, so 3 * 4 = 12 pens.\n"  # reasoning that the format reward pays for
RIGHT_FMT, RIGHT, WRONG_FMT, WRONG = WORK + "#### 3", "#### 3", WORK + "#### 4", "#### 4"
LONG, MID, SHORT, CUT = [5] * 5 + [EOS], [5] * 6 + [EOS], [5, 6, EOS], [5] * CAP
CONTEXTS = {
    "mixed": [[(RIGHT_FMT, SHORT), (RIGHT, MID), (WRONG_FMT, CUT), (WRONG, LONG)],
              [(RIGHT, SHORT), (WRONG_FMT, SHORT), (WRONG, MID)]],
    "flat": [[(RIGHT_FMT, SHORT), (RIGHT_FMT, MID), (RIGHT_FMT, CUT)], [(WRONG, SHORT), (WRONG, LONG), (WRONG, MID)]],
    "format_flat": [[(RIGHT_FMT, SHORT), (WRONG_FMT, MID), (WRONG_FMT, CUT)], [(RIGHT, SHORT), (WRONG, LONG),
                                                                               (WRONG, SHORT)]],
    "short": [[(RIGHT_FMT, SHORT), (RIGHT, SHORT), (WRONG_FMT, SHORT), (WRONG, [5, EOS])],
              [(RIGHT, SHORT), (WRONG_FMT, [EOS]), (WRONG, SHORT)]],
}
BASE = {"rewards": {"accuracy": 1.0, "format": 0.0}}


@dataclass(frozen=True)
class Knob:
    """A row: the setting, its overrides, the context where it must change the scored batch's advantages or valid
    lengths, the contexts where it must not (with why), and the baseline's own overrides."""

    setting: str
    overrides: dict
    moves_in: str
    still_in: dict[str, str]
    base: dict = field(default_factory=dict)


SCORING_KNOBS = [
    Knob("algorithm.advantage_estimator", {"advantage_estimator": "dr_grpo"}, "mixed",
         {"flat": "a group without a learning signal has advantage 0 under every estimator"}),
    Knob("algorithm.advantage_estimator", {"advantage_estimator": "rloo"}, "mixed",
         {"flat": "a group without a learning signal has advantage 0 under every estimator"}),
    Knob("algorithm.adv_eps", {"adv_eps": 0.5}, "mixed", {"flat": "all-equal groups are 0 before the division"}),
    Knob("algorithm.adv_std", {"adv_std": "biased"}, "mixed", {"flat": "all-equal groups are 0"}),
    Knob("algorithm.rewards", {"rewards": {"accuracy": 1.0, "format": 0.5}}, "mixed",
         {"format_flat": "a reward constant within every group shifts no group-normalised advantage"}),
    Knob("algorithm.reward_combine", {"reward_combine": "normalise-then-sum"}, "mixed",
         {"format_flat": "a reward constant within each group adds 0 either way"},
         base={"rewards": {"accuracy": 1.0, "format": 0.5}}),
    Knob("algorithm.mask_truncated", {"mask_truncated": True}, "mixed", {"short": "no completion is cut"}),
    Knob("algorithm.overlong_buffer_tokens", {"overlong_buffer_tokens": 4}, "mixed",
         {"short": "no completion reaches the buffer's last 4 tokens"}),
    Knob("algorithm.overlong_penalty_factor", {"overlong_penalty_factor": 3.0}, "mixed",
         {"short": "no completion is penalised"}, base={"overlong_buffer_tokens": 4}),
]
#: (setting, controller overrides, measured KL where β must move, measured KL where it must not, why).
CONTROLLER_KNOBS = [
    ("algorithm.kl_controller", {"kl_controller": "adaptive"}, 0.05, 0.01, "KL at the target: adaptive keeps β"),
    ("algorithm.kl_target", {"kl_controller": "adaptive", "kl_target": 0.02}, 0.015, 1.0,
     "far above both targets the error is clipped at +20 % for both"),
    ("algorithm.kl_horizon_sequences", {"kl_controller": "adaptive", "kl_horizon_sequences": 100}, 0.05, 0.01,
     "KL at the target: no step at any horizon"),
]
#: Settings that do not change the update of a batch, or whose effect is audited elsewhere: why, and where.
NOT_THE_UPDATE = {
    "algorithm.reward_on_error": "what a raising reward function does (tests/unit/test_rewards_registry.py)",
    "algorithm.max_infra_failed_fraction": "when the step stops for missing rewards (tests/unit/test_driver_scoring)",
    "algorithm.dynamic_sampling": "which groups are sampled and kept (tests/unit/test_sampling.py)",
    "algorithm.max_sampling_rounds": "how many sampling rounds (tests/unit/test_sampling.py)",
    "algorithm.group_size_schedule": "how many completions per prompt (tests/unit/test_sampling.py)",
    "algorithm.group_size_max": "how many completions per prompt (tests/unit/test_sampling.py)",
    "algorithm.group_size_rise_threshold": "when G rises (tests/unit/test_sampling.py)",
    "train.world_size": "the update is invariant to it (tests/distributed/test_algorithm_ranks.py, test_fsdp_parity)",
    "train.max_tokens_per_microbatch": "the update is invariant to it (tests/unit/test_packing_invariance.py)",
    "train.oversize_sequences": "whether an oversize sequence trains alone or stops the step (packing tests)",
    "train.reduce_dtype": "numerics of the gradient reduction (tests/distributed/test_mixed_precision.py)",
    "train.strategy": "the backend; the same update (tests/distributed/test_megatron_step*.py parity)",
    "train.tensor_parallel_size": "the update is invariant to it (test_megatron_step.py parity)",
    "train.pipeline_parallel_size": "the update is invariant to it (test_megatron_step.py parity)",
    "train.sequence_parallel": "the update is invariant to it (test_megatron_step.py parity)",
    "train.max_skipped_updates": "when repeated skipped updates stop the job (tests/ray/test_reliability.py)",
    "train.lora": "trains adapters instead of the weights (tests/distributed/test_lora_worker.py)",
    "train.lora.rank": "the adapters' shape (tests/unit/test_lora_adapters.py)",
    "train.lora.alpha": "the adapters' scale (tests/unit/test_lora_adapters.py: merge like PEFT)",
    "train.lora.dropout": "PEFT's adapter dropout (tests/unit/test_lora_adapters.py: config maps the spec)",
    "train.lora.target_modules": "which modules get adapters (tests/unit/test_lora_adapters.py)",
    "train.lora.init": "the adapters' initialisation (tests/unit/test_lora_adapters.py)",
    "train.lora.sync": "what the engines receive, not the update (weight-sync tests)",
    "algorithm.off_policy_correction": ("the default TIS in off-policy modes (tests/in_process/"
                                        "test_off_policy_default.py: same batches, a different step-2 update)"),
    "train.activation_checkpointing": "memory, not the update (tests/in_process/test_memory_knobs.py: equal update)",
    "train.cpu_offload": "where optimizer state lives, not the update (tests/in_process/test_memory_knobs.py)",
    **{f"train.{name}": "the learning rate of each step (tests/unit/test_training_knobs_spec.py, tests/in_process/"
                        "test_lr_schedule_resume.py)" for name in (
        "lr_schedule", "min_lr_ratio", "warmup_ratio", "warmup_steps")},
    **{f"train.{name}": "placement and threads of the ranks, not the update" for name in (
        "num_cpus_per_worker", "num_gpus_per_worker", "backend", "num_threads", "cpu_affinity", "timeout_s",
        "placement_strategy", "resources")},
}


def groups(context: str) -> tuple[list[GroupResult], list[str]]:
    out = []
    for gid, rows in enumerate(CONTEXTS[context]):
        texts, responses = [t for t, _ in rows], [r for _, r in rows]
        out.append(GroupResult(gid, [EOS, 11], responses, [torch.full((len(r),), -0.5) for r in responses],
                               ["stop" if EOS in r else "length" for r in responses], texts, 0))
    return out, ["#### 3"] * len(out)


def scored(context: str, overrides: dict):
    algorithm = AlgorithmSpec(**{**BASE, **overrides})
    batch = Scoring(algorithm, CAP, frozenset({EOS})).score(*groups(context))
    return batch.advantages, torch.tensor(batch.valid_lengths, dtype=torch.float32)


@pytest.mark.parametrize("knob", SCORING_KNOBS, ids=[f"{k.setting}={k.overrides}" for k in SCORING_KNOBS])
def test_the_setting_moves_the_scored_batch(knob):
    base_adv, base_len = scored(knob.moves_in, knob.base)
    adv, lengths = scored(knob.moves_in, {**knob.base, **knob.overrides})
    assert base_adv.abs().max() > 0.1  # the context has a learning signal
    assert (adv - base_adv).abs().max() > 1e-3 or not torch.equal(lengths, base_len), knob.setting
    for context, why in knob.still_in.items():
        base_adv, base_len = scored(context, knob.base)
        adv, lengths = scored(context, {**knob.base, **knob.overrides})
        assert torch.allclose(adv, base_adv, atol=1e-6, rtol=0) and torch.equal(lengths, base_len), (context, why)


@pytest.mark.parametrize("setting, overrides, moves_at, still_at, why", CONTROLLER_KNOBS,
                         ids=[row[0] for row in CONTROLLER_KNOBS])
def test_the_setting_moves_the_next_steps_kl_coef(setting, overrides, moves_at, still_at, why):
    """β after one update with 64 sequences, against the default (fixed, target 0.01, horizon 10,000); only the
    adaptive rows' own field differs from its baseline (the kl_controller row's baseline is fixed)."""
    base = {"kl_controller": "fixed"} if setting == "algorithm.kl_controller" else {"kl_controller": "adaptive"}

    def beta(fields: dict, kl: float) -> float:
        alg = AlgorithmSpec(**{**BASE, **fields})
        controller = make_kl_controller(alg.kl_controller, alg.kl_coef, alg.kl_target, alg.kl_horizon_sequences)
        controller.update(kl, 64)
        return controller.value

    assert abs(beta(overrides, moves_at) - beta(base, moves_at)) > 1e-9, setting
    assert beta(overrides, still_at) == pytest.approx(beta(base, still_at), rel=1e-12, abs=0), why


def _fields(model, prefix: str) -> set[str]:
    return {f"{prefix}{name}" for name in model.model_fields}


def test_every_setting_is_audited():
    """A new ``algorithm``/``train``/``train.lora`` field must be put in a table (its effect on the update tested) or
    in NOT_THE_UPDATE (why it has none, or where it is tested)."""
    fields = (_fields(AlgorithmSpec, "algorithm.") | _fields(TrainSpec, "train.") | _fields(LoraSpec, "train.lora.")
              | {"algorithm.mis.level", "algorithm.mis.low", "algorithm.mis.high"})
    audited = set(AUDITED) | {k.setting for k in SCORING_KNOBS} | {row[0] for row in CONTROLLER_KNOBS}
    assert sorted(fields - audited - set(NOT_THE_UPDATE)) == []
    assert sorted((audited | set(NOT_THE_UPDATE)) - fields) == []  # no stale row
    assert "algorithm" in JobSpec.model_fields and "train" in JobSpec.model_fields
