"""The Ray shell: everything that needs Ray, in one place, around the pure loop (``cluster.driver.GRPOJob``).

- ``pools``: the Ray actors (vLLM engine replicas, train ranks of the backend ``train.strategy`` names), their
  placement groups and timeouts;
- ``sync``: the weight-sync coordinator (train rank 0 + every engine worker; membership, one verified sync per policy
  version);
- ``fleet``: the engines as the loop sees them (generate and sync with engine replacement, re-sampling, scaling);
- ``runtime``: :class:`RayTrainer` and :class:`RayFleet`, the ``contract.protocols`` implementations the loop is given,
  and :func:`build_job`, which builds a ready job from a spec (what ``grpo-cluster run`` and submitted jobs call);
- ``restarts``: restart on a worker failure from the latest checkpoint;
- ``control``: the job control actor (``grpo-cluster scale``/``status``); ``ray_init``: Ray start-up.
"""
