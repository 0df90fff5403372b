"""FSDP2 mixed precision in the real train worker (one gloo rank, CPU, bfloat16 compute).

With ``model.dtype`` bfloat16 a 5e-6 AdamW step on a weight of 0.05 is lost when the parameter is bfloat16 (half a
bfloat16 ulp at 0.05 is 2⁻¹³ ≈ 1.2e-4) and kept with FSDP2's mixed precision: float32 parameters and AdamW state,
forward/backward in bfloat16 (the fused LM head + log-softmax included), weights sent to the engine in bfloat16.
"""

from __future__ import annotations

import torch

from tests.distributed.test_fsdp_parity import MAX_RESPONSE_TOKENS, TEMPERATURE, N, _capture_grads, make_batch, pack
from weight_sync.group import free_port

LR = 5e-6
WEIGHT = 0.05


def _worker(model_dir: str, dtype: str, **train):
    from cluster.spec import AlgorithmSpec, TrainSpec
    from train_workers.fsdp_worker import FSDPTrainWorker

    spec = TrainSpec(world_size=1, num_threads=2, timeout_s=120, **train)
    worker = FSDPTrainWorker(0, 1, model_dir, spec, AlgorithmSpec(kl_coef=0.04), TEMPERATURE, MAX_RESPONSE_TOKENS,
                             dtype=dtype, seed=0)
    worker.init_distributed("127.0.0.1", free_port())
    return worker


def _num_tokens() -> int:
    return sum(len(r) for r in make_batch()[1])


def test_pure_bfloat16_adamw_loses_the_step():
    """The premise: a bfloat16 parameter of 0.05 with a bfloat16 AdamW (the worker before mixed precision) does not
    move at lr 5e-6, whatever the gradient."""
    w = torch.full((8,), WEIGHT, dtype=torch.bfloat16, requires_grad=True)
    before = w.detach().clone()
    opt = torch.optim.AdamW([w], lr=LR, weight_decay=0.0)
    w.grad = torch.linspace(-1, 1, 8, dtype=torch.bfloat16)
    opt.step()
    assert torch.equal(w.detach(), before)


def test_mixed_precision_keeps_a_small_update(tiny_model_dir):
    from train_workers.sharding import full_tensor

    worker = _worker(tiny_model_dir, "bfloat16", lr=LR, weight_decay=0.0, reduce_dtype="float32")
    try:
        params = dict(worker.policy.model.named_parameters())
        assert {p.dtype for p in params.values()} == {torch.float32}  # master weights
        assert {p.dtype for p in worker.reference.parameters()} == {torch.bfloat16}  # frozen: compute dtype only
        target_name = "model.layers.0.self_attn.q_proj.weight"
        target = params[target_name]
        with torch.no_grad():
            target.to_local().fill_(WEIGHT)
        seen = {}
        layer = worker.policy.model.model.layers[0].self_attn.q_proj
        hook = layer.register_forward_hook(lambda m, i, o: seen.update(compute=(m.weight.dtype, o.dtype)))

        grads: dict[str, torch.Tensor] = {}
        _capture_grads(worker, grads)
        result = worker.train_step([pack(list(range(N)))], _num_tokens(), N)
        metrics = result.metrics
        hook.remove()

        assert seen["compute"] == (torch.bfloat16, torch.bfloat16)  # forward ran in bfloat16
        assert metrics["actor/update_skipped"] == 0.0 and result.policy_version == 1 and not result.skipped
        assert torch.isfinite(torch.tensor(metrics["actor/loss"])) and metrics["actor/grad_norm"] > 0
        grad = grads[target_name]
        assert grad.dtype == torch.float32
        step = (full_tensor(target).detach() - WEIGHT).abs()
        # AdamW's first step is lr·g/(|g| + eps): lr wherever |g| ≫ eps = 1e-8 (float32 spacing at 0.05 is 3.7e-9).
        counted = grad.abs() > 1e-6
        assert int(counted.sum()) > 0.5 * grad.numel()
        assert float(step[counted].min()) > 0.98 * LR and float(step.max()) < 1.002 * LR
        for state in worker.optimizer.state.values():
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32

        # Weight sync sends the engine's dtype: the float32 master cast to bfloat16.
        buckets = worker.sync_plan("bfloat16", 1 << 20)
        assert {s.dtype for b in buckets for s in b.slots} == {"bfloat16"}
        sent = worker.sender.source.tensor(target, torch.bfloat16)
        assert sent.dtype == torch.bfloat16 and torch.equal(sent, full_tensor(target).detach().to(torch.bfloat16))

        # The bfloat16 forward (fused LM head + log-softmax) agrees with the float32 parameters' reference run.
        mb = pack(list(range(N)))
        with torch.no_grad():
            lp_bf16, _ = worker.policy(*worker.engine.inputs(mb), with_entropy=False)
            lp_ref, _ = worker.reference(*worker.engine.inputs(mb), with_entropy=False)
        assert lp_bf16.dtype == torch.float32
        assert float((lp_bf16 - lp_ref).abs().max()) < 0.1
    finally:
        worker.shutdown()


def test_float32_job_has_no_mixed_precision(tiny_model_dir):
    """model.dtype float32: parameters, compute and reference policy all float32 (no FSDP2 casts)."""
    worker = _worker(tiny_model_dir, "float32", lr=1e-4)
    try:
        seen = {}
        layer = worker.policy.model.model.layers[0].self_attn.q_proj
        hook = layer.register_forward_hook(lambda m, i, o: seen.update(dtype=o.dtype))
        worker.train_step([pack([0, 1])], _num_tokens(), N)
        hook.remove()
        assert seen["dtype"] == torch.float32
        assert {p.dtype for p in worker.reference.parameters()} == {torch.float32}
    finally:
        worker.shutdown()


def test_shard_mixed_precision_on_a_bare_model():
    """``sharding.shard_mixed_precision`` (the entry point scripts use) on a bfloat16 HF model: float32 shards, bfloat16
    compute, float32 gradients on the shards."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny_model import TINY_CONFIG
    from train_workers.sharding import shard_mixed_precision

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        config = AutoConfig.for_model("llama", vocab_size=256, **TINY_CONFIG)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        shard_mixed_precision(model, "bfloat16", "float32")
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        ids = torch.randint(0, 256, (1, 12))
        logits = model(input_ids=ids, use_cache=False).logits
        assert logits.dtype == torch.bfloat16
        logits.float().logsumexp(-1).sum().backward()
        assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    finally:
        dist.destroy_process_group()
