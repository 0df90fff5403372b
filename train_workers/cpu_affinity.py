"""CPU cores and torch threads of a train rank (``train.cpu_affinity``, ``train.num_threads``).

Every backend calls :func:`bind_rank` first in its constructor, before any torch work: the rank's process is bound to
``train.cpu_affinity`` (``os.sched_setaffinity``) and torch's intra-op thread count is ``train.num_threads``, or one
thread per bound core when only the cores are given. Neither set: nothing changes (torch's own thread count, every
core the process may use).
"""

from __future__ import annotations

import os

import torch

__all__ = ["bind_rank", "pin_to_cores", "rank_threads"]


def pin_to_cores(cores: list[int], field: str) -> list[int]:
    """Bind this process to ``cores`` (``os.sched_setaffinity``; threads started afterwards inherit it) after
    checking that it may use them (``os.sched_getaffinity``: Ray's, the container's or taskset's limits on this
    node). The same check as ``rollout_workers.engine.pin_to_cores`` (the worker packages do not import each other).

    Returns:
        the cores the process now runs on, sorted.
    Raises:
        ValueError: a core the process may not use, naming ``field`` (e.g. ``train.cpu_affinity``), the cores asked
            for and the cores allowed.
    """
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cores) - allowed)
    if missing:
        raise ValueError(f"{field}: cores {missing} are not available to this process (pid {os.getpid()}); expected "
                         f"ids among the cores it may use, {sorted(allowed)}, got {cores}")
    os.sched_setaffinity(0, cores)
    return sorted(os.sched_getaffinity(0))


def rank_threads(num_threads: int | None, cores: list[int] | None) -> int | None:
    """torch intra-op threads of a rank: ``train.num_threads`` when set, else one per core of ``train.cpu_affinity``,
    else None (keep torch's)."""
    if num_threads is not None:
        return num_threads
    return None if cores is None else len(cores)


def bind_rank(train) -> int:
    """Apply ``train.cpu_affinity`` (:func:`pin_to_cores`) and the thread count of :func:`rank_threads` to this
    process.

    Args:
        train: the spec's ``TrainSpec``.
    Returns:
        torch's intra-op thread count afterwards.
    Raises:
        ValueError: from :func:`pin_to_cores`, naming ``train.cpu_affinity``.
    """
    if train.cpu_affinity is not None:
        pin_to_cores(train.cpu_affinity, "train.cpu_affinity")
    threads = rank_threads(train.num_threads, train.cpu_affinity)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
