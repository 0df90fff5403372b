"""The control plane: the job spec, the pure training loop, the runtimes that host it, operations and data.

Subpackages, one concern each: ``spec`` (the job spec), ``loop`` (the loop's parts), ``ray_shell`` (the Ray
runtime: pools, fleet, weight-sync coordinator, restarts, control actor, ``build_job``), ``in_process`` (the
in-process runtime, ``local_job``), ``ops`` (CLI subcommands, Jobs API, metrics, pre-start checks), ``data`` (prompts,
models, evaluation); ``driver.py`` (``GRPOJob``) and ``cli.py`` are the entry points. See docs/architecture.md.
"""
