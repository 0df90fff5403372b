"""The in-process runtime: the GRPO loop with every collaborator in the calling process, without Ray or vLLM.

    job = local_job(spec, progress=False)   # cluster.driver.GRPOJob with a LocalFleet and a LocalTrainer
    history = job.run()

- :class:`LocalTrainer` (``trainer``): one train rank of ``train.strategy``'s backend, its process group
  torch.distributed's default group of one.
- :class:`LocalFleet` (``fleet``): transformers sampling from the fleet's own copy of the policy (``sampling``:
  KV-cached decode, vLLM's seeding, filters and processed logprobs), logical engines, the version ledger, staleness.
- The weight sync between them (``sync``): the rank's real sender (``sync_plan``, ``init_sync_group``,
  ``broadcast_weights``) to a ``weight_sync`` receiver in this process, checksums verified.
- The reward pool (``reward_pool``): the reward functions in the driver (``reward_pool.workers: 0``), or in local
  worker processes (threads where the functions cannot be pickled).

Loop behaviour is tested on this runtime in seconds (``tests/in_process``); the Ray shell (``cluster.ray_shell``)
builds the real engines and ranks from the same spec. Imports neither Ray nor vLLM.
"""

from __future__ import annotations

from cluster.in_process.fleet import LocalFleet
from cluster.in_process.reward_pool import local_reward_pool
from cluster.in_process.trainer import LocalTrainer

__all__ = ["LocalFleet", "LocalTrainer", "local_job", "local_reward_pool"]


def local_job(spec, **job_kwargs):
    """``cluster.driver.GRPOJob(spec, fleet=LocalFleet(spec), trainer=LocalTrainer(spec),
    reward_pool=local_reward_pool(spec), **job_kwargs)``: a job whose fleet and trainer run in this process and whose
    reward functions run in it too, or in local worker processes (``reward_pool.workers``).

    Args:
        spec: the validated job spec.
        job_kwargs: the job's other keyword arguments (``sinks``, ``control``, ``progress``, ``resume``,
            ``dry_run``, ``resume_past_trip``; ``reward_pool`` replaces the spec's).
    """
    from cluster.driver import GRPOJob

    if "reward_pool" not in job_kwargs:
        job_kwargs["reward_pool"] = local_reward_pool(spec)
    return GRPOJob(spec, fleet=LocalFleet(spec), trainer=LocalTrainer(spec), **job_kwargs)
