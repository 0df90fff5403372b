"""``rollout.mode: one_step_off`` outside the schedule: the spec check (before Ray starts), the fleet's deferral of
engine recovery during an overlapped generate, and the checkpoint's data position of the trained batches only.
Stand-in pools (``tests/unit/test_driver_staleness.py``'s), no Ray."""

from __future__ import annotations

import pytest

from cluster.loop.checkpoint_state import driver_state
from cluster.ray_shell.fleet import EngineFleet
from contract.errors import RecoveryDeferred
from contract.versions import PolicyVersionLedger
from contract.messages import GroupRequest
from cluster.spec import SpecError, load_spec_text, spec_to_yaml
from tests.unit.test_driver_staleness import SPEC, FakeRollout, FakeSync


def test_one_step_off_implies_max_staleness_1_and_refuses_an_explicit_0_naming_the_set():
    """``grpo-cluster validate SPEC --set rollout.mode=one_step_off``: the mode implies max_staleness 1; an explicit
    0 is refused, blamed on the --set that made the spec inconsistent."""
    assert load_spec_text(SPEC, overrides=["rollout.mode=one_step_off"]).rollout.max_staleness == 1
    with pytest.raises(SpecError, match=r"--set rollout.max_staleness, --set rollout.mode: rollout.max_staleness: "
                                        r"rollout.mode 'one_step_off' .* expected max_staleness >= 1, got 0"):
        load_spec_text(SPEC, overrides=["rollout.mode=one_step_off", "rollout.max_staleness=0"])
    spec = load_spec_text(SPEC, overrides=["rollout.mode=one_step_off", "rollout.max_staleness=1"])
    assert spec.rollout.mode == "one_step_off"
    again = load_spec_text(spec_to_yaml(spec))
    assert again.rollout.mode == "one_step_off" and again.rollout.max_staleness == 1


def test_one_step_off_is_not_the_default_and_unknown_modes_are_refused():
    assert load_spec_text(SPEC).rollout.mode == "sync"
    with pytest.raises(SpecError, match=r"rollout.mode: Input should be 'sync', 'one_step_off' or 'async'"):
        load_spec_text(SPEC, overrides=["rollout.mode=partial", "rollout.max_staleness=1"])


def test_one_step_off_combines_with_dynamic_sampling_and_eval_sections():
    """Dynamic sampling runs all its rounds inside the prefetch; evaluation runs between steps, when nothing is in
    flight: both are accepted."""
    spec = load_spec_text(SPEC, overrides=["rollout.mode=one_step_off", "rollout.max_staleness=2",
                                           "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3"])
    assert spec.algorithm.dynamic_sampling and spec.rollout.max_staleness == 2


REQUESTS = [GroupRequest(0, [5, 6], 2, seed=1), GroupRequest(1, [7], 2, seed=2)]


def fleet(rollout) -> EngineFleet:
    spec = load_spec_text(SPEC, overrides=["rollout.mode=one_step_off", "rollout.max_staleness=1"])
    engines = EngineFleet(spec)
    engines.attach(rollout, FakeSync(), PolicyVersionLedger(3), lambda message: None)
    return engines


class DyingRollout(FakeRollout):
    """Engine 0 is dead until it is replaced: every call fails (``dead_engines`` names it)."""

    def __init__(self):
        super().__init__([3])
        self.replaced = 0

    def generate(self, requests, on_groups=None):
        import ray

        if self.replaced == 0:
            self.calls += 1
            raise ray.exceptions.RayActorError()
        return super().generate(requests, on_groups)

    def dead_engines(self):
        return [0] if self.replaced == 0 else []

    def replace(self, indices, version, cause):
        self.replaced += 1

    def where(self, indices):
        return "node x"


def test_one_step_off_overlapped_generate_defers_engine_recovery():
    f = fleet(DyingRollout())
    with pytest.raises(RecoveryDeferred, match="engine fault during a generate that overlaps training"):
        f.generate(REQUESTS, recover=False)
    assert f.rollout.replaced == 0 and f.sync.syncs == 0 and f.sync.rebuilds == 0  # nothing synced mid-train
    groups = f.generate(REQUESTS)  # after the sync (recover=True): replaced, resynced, sampled again
    assert [g.group_id for g in groups] == [0, 1] and f.rollout.replaced == 1 and f.sync.syncs == 1


def test_one_step_off_overlapped_generate_defers_stale_groups():
    f = fleet(FakeRollout([1]))  # trainer 3, max_staleness 1: version 1 is stale
    with pytest.raises(RecoveryDeferred, match="2 stale group"):
        f.generate(REQUESTS, recover=False)
    assert f.sync.syncs == 0 and f.sync.rebuilds == 0 and f.rollout.calls == 1


def test_one_step_off_checkpoint_records_the_position_before_the_inflight_batch():
    """driver_state with an in-flight batch: the data position and group-size state from before it was drawn, and
    its group count; without (sync): the queue's own position and no ``inflight_groups`` key."""

    class Queue:
        def state_dict(self):
            return {"sampler": {"epoch": 0, "offset": 6}, "pending_prompts": []}

    class Sizes:
        def state_dict(self):
            return {"raised": 8}

    class Skips:
        def state_dict(self):
            return {"skipped_updates": 0, "skipped_updates_total": 0}

    before = {"prompts": {"sampler": {"epoch": 0, "offset": 4}, "pending_prompts": [3]}, "group_size": {"raised": 0}}
    common = dict(step=2, policy_version=2, prompts=Queue(), prompts_filtered=0, model_path="m", kl_coef=0.0,
                  group_size=Sizes(), skips=Skips(), engine_restarts=0)
    state = driver_state(**common, inflight={"position": before, "groups": 2})
    assert state["sampler"] == {"epoch": 0, "offset": 4} and state["pending_prompts"] == [3]
    assert state["group_size"] == {"raised": 0} and state["inflight_groups"] == 2
    plain = driver_state(**common)
    assert plain["sampler"]["offset"] == 6 and plain["group_size"] == {"raised": 8} and "inflight_groups" not in plain
