"""The control plane: the job spec, the training loop and its worker pools, operations and data.

Subpackages, one concern each: ``spec`` (the job spec), ``loop`` (the loop's parts, the pools, the weight-sync
coordinator, the policy-version ledger), ``ops`` (CLI subcommands, Jobs API, control actor, metrics), ``data``
(prompts, models, evaluation); ``messages.py`` holds the typed messages that cross actor boundaries, ``driver.py``
(``GRPOJob``) and ``cli.py`` are the entry points. May import ``grpo``, ``weight_sync``, ``rollout_workers`` and
``train_workers`` (the loop: only the backend registry and protocol); see docs/architecture.md.
"""
