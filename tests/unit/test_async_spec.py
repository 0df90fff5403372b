"""``rollout.mode: async`` spec checks, before Ray starts: ``max_staleness`` >= 1, and pools that cannot overlap
(engines and train ranks packed on one GPU with no memory split) refused naming the field; CPU pools accepted."""

from __future__ import annotations

import pytest

from cluster.spec import SpecError, load_spec_text, spec_to_yaml
from tests.unit.test_driver_staleness import SPEC

ASYNC = ["rollout.mode=async", "rollout.max_staleness=2"]


def test_async_implies_max_staleness_1_and_refuses_an_explicit_0():
    assert load_spec_text(SPEC, overrides=["rollout.mode=async"]).rollout.max_staleness == 1
    with pytest.raises(SpecError, match=r"rollout.max_staleness: rollout.mode 'async' .* expected max_staleness >= 1, "
                                        r"got 0"):
        load_spec_text(SPEC, overrides=["rollout.mode=async", "rollout.max_staleness=0"])
    spec = load_spec_text(SPEC, overrides=ASYNC)
    assert spec.rollout.mode == "async" and spec.rollout.max_staleness == 2
    again = load_spec_text(spec_to_yaml(spec))
    assert again.rollout.mode == "async" and again.rollout.max_staleness == 2


def test_async_on_cpu_pools_is_accepted():
    """On CPU the engines and the train ranks share cores, which overlaps: never refused."""
    spec = load_spec_text(SPEC, overrides=[*ASYNC, "rollout.num_cpus_per_replica=1", "train.num_cpus_per_worker=1"])
    assert spec.rollout.num_gpus_per_replica == 0 and spec.train.num_gpus_per_worker == 0


@pytest.mark.parametrize("gpus", [
    # engine 0.5 GPU at 0.9 memory + one rank 0.5 GPU: packed on one GPU, 0.9 + 0.5 > 1
    ["rollout.num_gpus_per_replica=0.5", "train.num_gpus_per_worker=0.5", "rollout.gpu_memory_utilization=0.9"],
    # two ranks of 0.25 and an engine of 0.5 at the default 0.5 memory: 0.5 + 0.5 = 1 is a split; 0.6 is not
    ["rollout.num_gpus_per_replica=0.5", "train.world_size=2", "train.num_gpus_per_worker=0.25",
     "rollout.gpu_memory_utilization=0.6"],
])
def test_async_refuses_pools_sharing_one_gpu_without_a_memory_split(gpus):
    with pytest.raises(SpecError, match=r"rollout.mode: 'async' overlaps generation with training, .* can share one "
                                        r"GPU, and rollout.gpu_memory_utilization .* expected a memory split"):
        load_spec_text(SPEC, overrides=[*ASYNC, *gpus])
    sync = load_spec_text(SPEC, overrides=[o for o in ASYNC if "mode" not in o] + gpus)  # sync never overlaps
    assert sync.rollout.mode == "sync"


@pytest.mark.parametrize("gpus", [
    # a memory split on the one GPU: the engine's 0.5 + the ranks' 0.5
    ["rollout.num_gpus_per_replica=0.5", "train.num_gpus_per_worker=0.5", "rollout.gpu_memory_utilization=0.5"],
    # separate GPUs: 1 + 1 reserved
    ["rollout.num_gpus_per_replica=1.0", "train.num_gpus_per_worker=1.0", "rollout.gpu_memory_utilization=0.9"],
    # engines on GPU, trainers on CPU
    ["rollout.num_gpus_per_replica=1.0", "rollout.gpu_memory_utilization=0.9"],
])
def test_async_accepts_pools_that_can_overlap(gpus):
    assert load_spec_text(SPEC, overrides=[*ASYNC, *gpus]).rollout.mode == "async"


@pytest.mark.parametrize("gpus", [
    # 2 GPUs reserved in all, but an engine's 0.5 and a rank's 0.5 fit on one GPU: Ray may pack them, 0.9 + 0.5 > 1
    ["rollout.num_gpus_per_replica=0.5", "train.world_size=3", "train.num_gpus_per_worker=0.5",
     "rollout.gpu_memory_utilization=0.9"],
    # two engines and two ranks of 0.5 each on two GPUs: one GPU may hold an engine and a rank
    ["rollout.replicas=2", "rollout.num_gpus_per_replica=0.5", "train.world_size=2", "train.num_gpus_per_worker=0.5",
     "rollout.gpu_memory_utilization=0.9"],
    # a tensor-parallel engine of 1 GPU is two bundles of 0.5 (RolloutPool._spawn): a rank's 0.5 fits beside one
    ["rollout.num_gpus_per_replica=1.0", "rollout.tensor_parallel_size=2", "train.num_gpus_per_worker=0.5",
     "rollout.gpu_memory_utilization=0.9"],
    # 4 ranks of 0.25 beside an engine of 0.25: 3 of them fit on its GPU, 0.5 + 0.75 > 1
    ["rollout.num_gpus_per_replica=0.25", "train.world_size=4", "train.num_gpus_per_worker=0.25"],
])
def test_async_refuses_fractional_pools_that_can_share_a_gpu_across_several(gpus):
    """Reservations summing to more than 1 GPU do not keep the pools apart: Ray packs fractional requests onto any
    GPU with room, so an engine and train ranks share one whenever their fractions fit together."""
    with pytest.raises(SpecError, match=r"rollout.mode: 'async' overlaps generation with training, .* can share one "
                                        r"GPU, .* expected a memory split"):
        load_spec_text(SPEC, overrides=[*ASYNC, *gpus])


@pytest.mark.parametrize("gpus", [
    # the same packings with a memory split on the shared GPU
    ["rollout.num_gpus_per_replica=0.5", "train.world_size=3", "train.num_gpus_per_worker=0.5",
     "rollout.gpu_memory_utilization=0.5"],
    ["rollout.num_gpus_per_replica=0.25", "train.world_size=4", "train.num_gpus_per_worker=0.25",
     "rollout.gpu_memory_utilization=0.25"],
    # whole-GPU engines never share with a rank, however many fractional ranks there are
    ["rollout.num_gpus_per_replica=1.0", "train.world_size=3", "train.num_gpus_per_worker=0.5",
     "rollout.gpu_memory_utilization=0.9"],
    # whole-GPU ranks beside fractional engines
    ["rollout.replicas=2", "rollout.num_gpus_per_replica=0.5", "train.num_gpus_per_worker=1.0",
     "rollout.gpu_memory_utilization=0.9"],
    # an engine of 0.7 and ranks of 0.4: no rank fits beside an engine
    ["rollout.num_gpus_per_replica=0.7", "train.world_size=2", "train.num_gpus_per_worker=0.4",
     "rollout.gpu_memory_utilization=0.9"],
])
def test_async_accepts_fractional_pools_that_cannot_share_a_gpu_or_split_it(gpus):
    assert load_spec_text(SPEC, overrides=[*ASYNC, *gpus]).rollout.mode == "async"
