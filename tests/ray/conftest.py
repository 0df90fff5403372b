"""Fixtures shared by the Ray tests: a local 2-CPU Ray instance per module, the ``parity`` test reward, and a
``ray start --head`` cluster on 127.0.0.1 for the Jobs API tests."""

from __future__ import annotations

import pytest

from tests.registered import temporarily_registered


@pytest.fixture(scope="module")
def local_ray():
    """``ray.init`` with 2 CPUs, no dashboard; shut down after the module."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def parity_reward(completions: list[str], references: list[str]) -> list[float]:
    """1.0 for a completion with an even number of characters, else 0.0 (a random tiny model never solves GSM8K;
    parity gives its groups unequal rewards, so a learning signal)."""
    return [1.0 if len(c) % 2 == 0 else 0.0 for c in completions]


@pytest.fixture(scope="module")
def parity_registered():
    """Register the test reward ``parity`` unless it is there; removed again after the
    module when this fixture added it, so the rest of the session sees the builtin registry."""
    yield from temporarily_registered("parity", parity_reward)



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
