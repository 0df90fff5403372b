"""CPU cores and torch threads of a train rank (``train.cpu_affinity``, ``train.num_threads``).

Every backend's constructor calls :func:`bind_rank` first, before any torch work (through
``train_workers.rank_context.RankContext.create``): the rank's process is bound to ``train.cpu_affinity``
(:func:`contract.affinity.pin_to_cores`, the check and binding the rollout engines use too) and torch's intra-op thread
count is ``train.num_threads``, or one thread per bound core when only the cores are given. Neither set: nothing
changes (torch's own thread count, every core the process may use).
"""

from __future__ import annotations

import torch

from contract.affinity import pin_to_cores

__all__ = ["bind_rank", "pin_to_cores", "rank_threads"]


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
