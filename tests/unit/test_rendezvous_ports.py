"""``weight_sync.group.free_port`` / ``free_ports``: the range ``$GRPO_CLUSTER_RENDEZVOUS_PORTS`` sets, distinct
ports for a run that needs several, a clear error for a malformed range, and (under pytest-xdist) each worker's own
share of the range (tests/conftest.py), so that two workers cannot draw each other's ports."""

from __future__ import annotations

import os

import pytest

from weight_sync.group import PORT_RANGE_ENV, RENDEZVOUS_PORT_MIN, _ephemeral_port_range, free_port, free_ports


def test_ports_come_from_the_range_the_environment_sets(monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "23000-23012")
    assert all(23000 <= free_port() < 23012 for _ in range(40))
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(23000 <= p < 23012 for p in ports)


@pytest.mark.parametrize("text", ["23000", "a-b", "23010-23000", "0-10", "1-70000"])
def test_a_malformed_range_names_the_variable(monkeypatch, text):
    monkeypatch.setenv(PORT_RANGE_ENV, text)
    with pytest.raises(ValueError, match=rf"\$GRPO_CLUSTER_RENDEZVOUS_PORTS: expected LOW-HIGH .*got {text!r}"):
        free_port()


def test_each_xdist_worker_draws_from_its_own_share():
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or _ephemeral_port_range() is None:
        pytest.skip("not under pytest-xdist with two or more workers")
    low, high = (int(x) for x in os.environ[PORT_RANGE_ENV].split("-"))
    k, width = int(worker[2:]), (_ephemeral_port_range()[0] - RENDEZVOUS_PORT_MIN) // count
    assert (low, high) == (RENDEZVOUS_PORT_MIN + k * width, RENDEZVOUS_PORT_MIN + (k + 1) * width)
