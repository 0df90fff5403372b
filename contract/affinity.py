"""Binding a process to CPU cores: the one check-then-bind that engines and train ranks share.

Every rollout engine binds its actor (and the processes it starts, vLLM's) to ``rollout.cpu_affinity``;
``train_workers.cpu_affinity`` binds a train rank to ``train.cpu_affinity``. Both call :func:`pin_to_cores`. Standard
library only.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["pin_to_cores"]


def pin_to_cores(cores: list[int], field: str, describe: Callable[[list[int]], str] = str) -> list[int]:
    """Bind this process to ``cores`` (``os.sched_setaffinity``; threads and child processes started afterwards
    inherit it) after checking that it may use them (``os.sched_getaffinity``: Ray's, the container's or taskset's
    limits on this node).

    Args:
        cores: CPU core ids to run on.
        field: the spec field they come from (``rollout.cpu_affinity``, ``train.cpu_affinity``), named in the error.
        describe: how the error writes the sorted ids of the cores allowed (default ``str``: ``[0, 1, 2]``; the
            rollout engine passes its cpulist formatter, ``"0-2"``).

    Returns:
        the cores the process now runs on, sorted.
    Raises:
        ValueError: a core the process may not use, naming ``field``, the cores asked for and the cores allowed; the
            binding is then unchanged.
    """
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cores) - allowed)
    if missing:
        raise ValueError(f"{field}: cores {missing} are not available to this process (pid {os.getpid()}); expected "
                         f"ids among the cores it may use, {describe(sorted(allowed))}, got {cores}")
    os.sched_setaffinity(0, cores)
    return sorted(os.sched_getaffinity(0))
