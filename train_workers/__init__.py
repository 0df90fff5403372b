"""Train backends: one rank of the policy (and the frozen reference policy) per Ray actor.

Each backend implements the ``TrainWorker`` protocol (``contract.train_worker``) and is chosen by ``train.strategy``
from the registry (``registry``). A backend is composed of parts, each with one role; no class inherits another
backend's implementation:

- ``rank_context``: the rank's settings and the set-up every backend shares (cores and threads, device, process
  group, seeding, AdamW, the rank report), built from the constructor arguments (``RankContext``);
- ``grpo_step``: the backend-neutral GRPO step (loss, KL, TIS/MIS, behaviour pass, NaN/Inf skip, ``TrainResult``;
  ``GRPOStep``), with its metric sums in ``step_metrics``, driving a backend's engine through the ``StepEngine``
  protocol (``step_engine``);
- ``weight_sender``: the backend-neutral weight-sync sender (bucket plan, sync group, streaming; ``WeightSender``)
  over a backend's ``SyncSource``.

FSDP2: ``fsdp_worker`` (the rank: builds and shards the models, checkpoints), ``fsdp_engine`` (its ``StepEngine``),
``fsdp_sync`` (its ``SyncSource``), with ``sharding``, ``packing``, ``policy``, ``checkpoint_io``, ``cpu_affinity``
and, for ``train.lora``, ``lora`` and ``lora_checkpoint``. Megatron-core: the ``megatron`` package. May import torch,
``torch.distributed``, transformers, Ray, ``grpo``, ``weight_sync`` and ``contract``; never ``rollout_workers`` or
any part of ``cluster``.
"""
