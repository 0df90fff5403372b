"""The Ray shell: everything that needs Ray, in one place, around the pure loop (``cluster.driver.GRPOJob``).

- ``pools`` (what the pools share: failure types, resource needs, ``get`` with a deadline, placement groups),
  ``rollout_pool`` (the rollout engine actors of ``rollout.engine``) and ``train_pool`` (the train ranks of the
  backend ``train.strategy`` names, and :class:`~cluster.ray_shell.train_pool.RayTrainer`, the
  ``contract.protocols.Trainer`` on Ray);
- ``sync``: the weight-sync coordinator (train rank 0 + every engine worker; membership, one verified sync per
  policy version);
- ``fleet``: :class:`~cluster.ray_shell.fleet.EngineFleet`, the ``contract.protocols.Fleet`` on Ray (generate and
  sync with engine replacement, re-sampling, scaling);
- ``runtime``: :func:`~cluster.ray_shell.runtime.build_job`, which builds a ready job from a spec (what
  ``grpo-cluster run`` and submitted jobs call), and the control channel over the control actor;
- ``restarts``: restart on a worker failure from the latest checkpoint;
- ``control``: the job control actor (``grpo-cluster scale``/``status``); ``ray_init``: Ray start-up.

Import the parts from their modules (``from cluster.ray_shell.runtime import build_job``): this package file imports
nothing, so ``python -m cluster.ray_shell.control`` runs where only Ray is installed.
"""
