"""Where the reward functions run: the reward pool the loop scores through (``contract.protocols.RewardPool``).

- ``calls``: one call's evaluation, packing calls into batches of ``reward_pool.batch_size`` rows, splitting the
  scores back;
- ``inline``: :class:`~cluster.rewards.inline.InlineRewardPool`, the functions in the driver (``reward_pool.workers:
  0``, the default);
- ``pool``: :class:`~cluster.rewards.pool.WorkerPool`, a pool over any runtime's workers (one driver-side thread per
  worker, per-call timeouts, replacement of a worker that died or timed out);
- ``worker``: what runs inside a worker (the plan of reward functions to load, one chunk's scoring, the wire form of
  the results).

The runtimes make the workers: Ray actors (``cluster.ray_shell.reward_pool``), local processes or threads
(``cluster.in_process.reward_pool``). Nothing here imports Ray. Import the parts from their modules.
"""
