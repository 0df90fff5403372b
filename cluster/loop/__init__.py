"""The training loop's parts, each owning one phase or one fact, called in turn by ``cluster/driver.py``.

setup, requests, fleet, scoring, sampling, scheduler, training, step_metrics, checkpoint_state, checkpoints,
restarts, pools, sync (the weight-sync coordinator) and versions (the policy-version ledger). May import
``cluster.spec``, ``contract.messages``, ``cluster.data``, ``cluster.ops.metrics``, ``grpo``, ``weight_sync``,
``rollout_workers`` and, of ``train_workers``, the backend registry, the protocol and shared helpers (packing),
never a concrete backend module (``tests/unit/test_import_layering.py``).
"""
