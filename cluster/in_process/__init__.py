"""The in-process runtime: the GRPO loop with every collaborator in the calling process, without Ray or vLLM.

    job = local_job(spec, progress=False)   # cluster.driver.GRPOJob with a LocalFleet and a LocalTrainer
    history = job.run()

- :class:`LocalTrainer` (``trainer``): one train rank of ``train.strategy``'s backend, its process group
  torch.distributed's default group of one.
- :class:`LocalFleet` (``fleet``): the ``hf`` rollout engine (``rollout_workers.hf``: the fleet's own copy of the
  policy, KV-cached decode, vLLM's seeding, filters, processed logprobs and stop strings) in this process, logical
  engines, the version ledger, the fleets' staleness gate.
- The weight sync between them (``sync``): the rank's real sender (``sync_plan``, ``init_sync_group``,
  ``broadcast_weights``) to the engine's own receiving side in this process, checksums verified.
- The reward pool (``reward_pool``): the reward functions in the driver (``reward_pool.workers: 0``), or in local
  worker processes (threads where the functions cannot be pickled).
- The agent pool (``agent_pool``): agents' episodes (``rollout.agent``) in local worker processes.

Loop behaviour is tested on this runtime in seconds (``tests/in_process``); the Ray shell (``cluster.ray_shell``)
builds the real engines and ranks from the same spec. Imports neither Ray nor vLLM.
"""

from __future__ import annotations

from cluster.in_process.agent_pool import local_agent_pool
from cluster.in_process.fleet import LocalFleet
from cluster.in_process.progress import library_progress_bars
from cluster.in_process.reward_pool import local_reward_pool
from cluster.in_process.trainer import LocalTrainer

__all__ = ["LocalFleet", "LocalTrainer", "local_agent_pool", "local_job", "local_reward_pool"]


def local_job(spec, **job_kwargs):
    """``cluster.driver.GRPOJob(spec, fleet=LocalFleet(spec), trainer=LocalTrainer(spec),
    reward_pool=local_reward_pool(spec), agent_pool=local_agent_pool(spec), agent_endpoint=job_endpoint(spec,
    fleet), **job_kwargs)``: a job whose fleet and trainer run in this process and whose reward functions run in it
    too, or in local worker processes (``reward_pool.workers``), and whose agents' episodes run in local worker
    processes against the agent endpoint (``cluster.endpoint.job``) served in this process.

    With ``progress=False`` transformers' and huggingface_hub's progress bars ("Loading weights") are off while the
    job is built and while its fleet and trainer load models (:mod:`cluster.in_process.progress`), as the job's own bar
    is; the libraries' settings are as they were outside those moments.

    Args:
        spec: the validated job spec.
        job_kwargs: the job's other keyword arguments (``sinks``, ``control``, ``progress``, ``resume``,
            ``dry_run``, ``resume_past_trip``, ``agent_endpoint``; ``reward_pool`` and ``agent_pool`` replace the
            spec's).
    """
    from cluster.driver import GRPOJob
    from cluster.endpoint.job import job_endpoint

    progress = job_kwargs.get("progress", True)
    fleet = LocalFleet(spec, progress=progress)
    if "reward_pool" not in job_kwargs:
        job_kwargs["reward_pool"] = local_reward_pool(spec)
    if "agent_pool" not in job_kwargs:
        job_kwargs["agent_pool"] = local_agent_pool(spec)
    if "agent_endpoint" not in job_kwargs:
        job_kwargs["agent_endpoint"] = job_endpoint(spec, fleet)
    with library_progress_bars(progress):  # the job's checks may convert or read the model
        return GRPOJob(spec, fleet=fleet, trainer=LocalTrainer(spec, progress=progress), **job_kwargs)
