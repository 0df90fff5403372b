"""What every rollout engine reports about itself (``RolloutEngine.ready``): engine-neutral."""

from __future__ import annotations

import os

from contract.messages import EngineInfo

__all__ = ["engine_info"]


def engine_info(policy_version: int | None) -> EngineInfo:
    """This process's :class:`EngineInfo`: ``policy_version``, process id, and where it really runs (Ray node id and
    the GPU ids Ray gave this process, read here rather than inferred from a placement bundle; None and [] outside
    Ray), its CPU cores. Shared by every engine's ``ready``."""
    node_id, gpu_ids = None, []
    try:
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
            gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # noqa: BLE001 - outside Ray (tests build the engine in-process)
        pass
    return EngineInfo(policy_version=policy_version, pid=os.getpid(), node_id=node_id, gpu_ids=gpu_ids,
                      cpu_cores=sorted(os.sched_getaffinity(0)))
