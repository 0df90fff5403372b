"""Weight-sync transport: bucket plans, the sync process group, transports (broadcast, shared memory, CUDA IPC), the
sender's streaming and checksum verification; one sync moves a policy's weights from train rank 0 to every engine.

Transport only: it knows no pools, membership or policy-version bookkeeping (the coordinator is
``cluster.ray_shell.sync``). May import torch, ``torch.distributed`` and Ray; never ``cluster``
(``tests/unit/test_import_layering.py``).
"""
