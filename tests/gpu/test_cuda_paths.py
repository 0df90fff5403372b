"""GPU paths: the CUDA vLLM engine's logprobs and the NCCL weight-sync group. Skipped without CUDA (conftest)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu


def _rollout_spec():
    return SimpleNamespace(num_gpus_per_replica=1, kv_cache_gib=1, temperature=0.7, top_p=1.0, max_response_tokens=16,
                           enforce_eager=True, tensor_parallel_size=1, gpu_memory_utilization=0.3)


def _hf_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response], device=model.device)
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, device=model.device)[:, None])[:, 0].cpu()


def test_cuda_engine_logprobs_and_nccl_sync(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from contract.messages import GroupRequest
    from rollout_workers.vllm.engine import VLLMEngine
    from weight_sync.buckets import bucket_checksums, pack_bucket, plan_buckets
    from weight_sync.group import SyncGroup, free_port

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL between a trainer and an engine needs two GPUs (NCCL cannot put two ranks on one GPU)")
    engine = VLLMEngine(tiny_model_dir, _rollout_spec(), "float32", 0, 256)
    prompt = list(range(10, 30))
    (group,), _ = engine.generate([GroupRequest(0, prompt)], 2)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to("cuda:1")
    ref = _hf_logprobs(hf, prompt, group.response_ids[0], 0.7)
    assert (ref - group.behaviour_logprobs[0]).abs().max() < 1e-3

    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.01)
    named = list(hf.named_parameters())
    buckets = plan_buckets([(n, p.shape, p.dtype) for n, p in named], 1 << 20)
    port, holder, sent = free_port(), {}, {}
    # The trainer side runs in threads; torch.cuda.set_device is per thread, so its GPU is passed explicitly.
    joiner = threading.Thread(target=lambda: holder.setdefault(
        "g", SyncGroup("127.0.0.1", port, 0, 2, 120, "nccl", device=1)))
    joiner.start()
    engine.init_weight_sync("127.0.0.1", port, 1, 2, buckets, 120, "nccl")
    joiner.join()

    def send():
        torch.cuda.set_device(1)  # this thread's own current device (synchronize below waits on cuda:1)
        params = dict(named)
        for b in buckets:
            buf = pack_bucket(b, [params[s.name].detach().cpu() for s in b.slots])
            sent.update(bucket_checksums(b, buf))
            holder["g"].broadcast(buf.to("cuda:1"))
        torch.cuda.synchronize()

    sender = threading.Thread(target=send)
    sender.start()
    report = engine.receive_weights(1, True)
    sender.join()
    assert report.worker_checksums[0] == sent
    assert holder["g"].device == torch.device("cuda", 1)
    (group,), _ = engine.generate([GroupRequest(1, prompt)], 2)
    assert group.policy_version == 1
    ref = _hf_logprobs(hf, prompt, group.response_ids[0], 0.7)
    assert (ref - group.behaviour_logprobs[0]).abs().max() < 1e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp2_on_nccl_single_rank(tiny_model_dir, dtype):
    """One FSDP2 rank on NCCL: a train step runs on the GPU and moves the weights (bfloat16: mixed precision,
    float32 parameters)."""
    from cluster.spec import AlgorithmSpec, TrainSpec
    from train_workers.fsdp_worker import FSDPTrainWorker
    from train_workers.packing import pack_microbatch
    from weight_sync.group import free_port

    train = TrainSpec(world_size=1, num_gpus_per_worker=1, lr=1e-3)
    worker = FSDPTrainWorker(0, 1, tiny_model_dir, train, AlgorithmSpec(), 1.0, 16, dtype=dtype)
    info = worker.init_distributed("127.0.0.1", free_port())
    assert info.backend == "nccl"
    before = {n: p.full_tensor().detach().clone() for n, p in worker.policy.named_parameters()}
    mb = pack_microbatch([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], [1.0, -1.0],
                         [torch.zeros(2), torch.zeros(3)], [0, 1])
    metrics = worker.train_step([mb], 5, 2).metrics
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/update_skipped"] == 0.0
    assert {p.dtype for p in worker.policy.parameters()} == {torch.float32}
    moved = any(not torch.equal(before[n], p.full_tensor()) for n, p in worker.policy.named_parameters())
    worker.shutdown()
    assert moved
