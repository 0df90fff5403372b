"""``rollout.mode: async`` spec checks, before Ray starts: ``max_staleness`` >= 1, and pools that cannot overlap
(engines and train ranks packed on one GPU with no memory split) refused naming the field; CPU pools accepted."""

from __future__ import annotations

import pytest

from cluster.spec import SpecError, load_spec_text, spec_to_yaml
from tests.unit.test_driver_staleness import SPEC

ASYNC = ["rollout.mode=async", "rollout.max_staleness=2"]


def test_async_needs_max_staleness_1_named_before_start():
    with pytest.raises(SpecError, match=r"rollout.max_staleness: rollout.mode 'async' .* expected max_staleness >= 1, "
                                        r"got 0"):
        load_spec_text(SPEC, overrides=["rollout.mode=async"])
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
