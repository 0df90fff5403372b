"""Train backends: one data-parallel rank of the policy (and the frozen reference policy) per Ray actor.

Each backend implements the ``TrainWorker`` protocol (``base``) and is chosen by ``train.strategy`` from the registry
(``registry``); FSDP2 is the first (``fsdp_worker``, ``fsdp_step``, ``fsdp_sync``, with ``sharding``, ``packing``,
``policy``, ``checkpoint_io``). May import torch, ``torch.distributed``, transformers, Ray, ``grpo``,
``weight_sync`` and ``contract.messages``; never ``rollout_workers`` or any other part of ``cluster``.
"""
