"""Where a job's metrics go, every step: ``metrics.jsonl``, ``workers.jsonl`` and Prometheus gauges (``metrics``),
experiment trackers (``trackers/``: the sink that never stops the job, the registry keyed by ``metrics.trackers``,
one module per tracker) and the run picture they attach at the end (``plot``, also ``grpo-cluster plot``).

The loop (``cluster.driver``) and the runtimes call these; they import neither the loop, the runtimes nor the
command line (``cluster.ops``, ``cluster.cli``): tests/unit/test_import_layering.py.
"""
