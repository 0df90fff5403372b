"""A LoRA policy in mixed precision (``model.dtype: bfloat16``, ``train.reduce_dtype: float32``), one gloo rank.

With ``kl_coef`` > 0 the step's first forward is the reference pass, inside PEFT's ``disable_adapter()``, which sets
the adapters' ``requires_grad`` to False while FSDP2 initialises its parameter groups; FSDP2 then finds no trainable
parameter and reduces gradients in the compute dtype. ``LoraPolicy.adapters_off`` keeps the sharded adapters
trainable: every decoder layer's group reduces in float32 (read from FSDP2's group state, a private attribute: the
reduce dtype has no public accessor), the adapters get float32 gradients and train, and every parameter stays
float32 with only the adapters changed.
"""

from __future__ import annotations

import torch

from tests.distributed.test_fsdp_parity import MAX_RESPONSE_TOKENS, TEMPERATURE, N, make_batch, pack
from weight_sync.group import free_port


def test_lora_bfloat16_policy_reduces_adapter_gradients_in_float32(tiny_model_dir):
    from cluster.spec import AlgorithmSpec, LoraSpec, TrainSpec
    from train_workers.fsdp_worker import FSDPTrainWorker
    from train_workers.lora import is_adapter
    from train_workers.sharding import decoder_layers, full_tensor

    train = TrainSpec(world_size=1, num_threads=2, lr=1e-3, timeout_s=120, lora=LoraSpec(rank=4))
    worker = FSDPTrainWorker(0, 1, tiny_model_dir, train, AlgorithmSpec(kl_coef=0.04), TEMPERATURE,
                             MAX_RESPONSE_TOKENS, dtype="bfloat16")
    worker.init_distributed("127.0.0.1", free_port())
    try:
        before = {n: full_tensor(p).detach().clone() for n, p in worker.policy.model.named_parameters()}
        grad_dtypes: set[torch.dtype] = set()
        step = worker.optimizer.step

        def recording_step(*args, **kwargs):
            grad_dtypes.update(p.grad.dtype for g in worker.optimizer.param_groups for p in g["params"]
                               if p.grad is not None)
            return step(*args, **kwargs)

        worker.optimizer.step = recording_step
        num_tokens = sum(len(r) for r in make_batch()[1])
        for _ in range(2):
            worker.train_step([pack([0, 1, 2]), pack([3, 4, 5])], num_tokens, N)
        for layer in decoder_layers(worker.policy):
            group = layer._get_fsdp_state()._fsdp_param_group
            assert group._reduce_dtype == torch.float32 and group._orig_dtype == torch.float32
        assert all(p.requires_grad for p in worker._lora.trainable)
        assert grad_dtypes == {torch.float32}
        after = {n: full_tensor(p).detach() for n, p in worker.policy.model.named_parameters()}
        assert {p.dtype for p in after.values()} == {torch.float32}
        moved = [n for n in before if not torch.equal(before[n], after[n])]
        assert moved and all(is_adapter(n) for n in moved) and len(moved) == sum(map(is_adapter, before))
    finally:
        worker.shutdown()
