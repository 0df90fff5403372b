"""The lean CPU fast paths that ``train.activation_checkpointing`` turns on change no result (two gloo ranks).

With activation checkpointing a CPU rank keeps the policy gathered once per step as before, but reduce-scatters its
gradients after every micro-batch (the rank accumulates its gradient shard, not a full-size gradient) and shards the
frozen reference policy instead of replicating it (``train_workers.fsdp_engine``). Checked here:

1. The mode is in effect: the reference policy is an FSDP2 module; after the first of a rank's two micro-batches the
   policy's (sharded) parameters already hold their gradient shard, where the speed paths leave it empty until the
   last micro-batch.
2. Two GRPO steps (the second with a nonzero KL to the reference policy) give the same loss, KL, entropy, grad norm,
   clipped gradients (to 1e-6 of the largest) and parameters as the speed paths without checkpointing.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.multiprocessing as mp

from tests.distributed.test_fsdp_parity import (
    MAX_RESPONSE_TOKENS,
    TEMPERATURE,
    N,
    _capture_grads,
    _full_params,
    assert_same_grads,
    assert_same_params,
    make_batch,
    pack,
)
from weight_sync.group import free_port

MICROBATCHES = [[[0, 1], [2]], [[3, 4, 5], []]]  # rank 0: two micro-batches; rank 1: one + the placeholder


def _worker(rank: int, port: int, model_dir: str, checkpointing: bool):
    from cluster.spec import AlgorithmSpec, TrainSpec
    from train_workers.fsdp_worker import FSDPTrainWorker

    train = TrainSpec(world_size=2, num_threads=1, lr=1e-4, max_grad_norm=1.0, timeout_s=120,
                      activation_checkpointing=checkpointing)
    worker = FSDPTrainWorker(rank, 2, model_dir, train, AlgorithmSpec(kl_coef=0.04), TEMPERATURE,
                             MAX_RESPONSE_TOKENS, dtype="float32", seed=0)
    worker.init_distributed("127.0.0.1", port)
    return worker


def _record_grad_presence(worker, into: list) -> None:
    """After each micro-batch's backward, append whether every trained (sharded) parameter holds a gradient."""
    backward = worker.engine.backward

    def recording_backward(loss):
        backward(loss)
        into.append(all(p.grad is not None for p in worker.optimizer.param_groups[0]["params"]))

    worker.engine.backward = recording_backward


def _step(worker, rank: int) -> dict:
    _, responses, _ = make_batch()
    return asdict(worker.train_step([pack(idx) for idx in MICROBATCHES[rank]], sum(len(r) for r in responses), N))


def _ranks_main(rank: int, model_dir: str, ports: list[int], out_dir: str):
    from torch.distributed.fsdp import FSDPModule

    torch.set_num_threads(1)
    for name, checkpointing, port in (("speed", False, ports[0]), ("lean", True, ports[1])):
        worker = _worker(rank, port, model_dir, checkpointing)
        mode = {"lean": worker.engine.lean, "reference_sharded": isinstance(worker.reference, FSDPModule)}
        presence: list[bool] = []
        _record_grad_presence(worker, presence)
        grads1, grads2 = {}, {}
        plain_step = worker.optimizer.step
        _capture_grads(worker, grads1)
        m1 = _step(worker, rank)
        worker.optimizer.step = plain_step
        _capture_grads(worker, grads2)
        m2 = _step(worker, rank)
        params = _full_params(worker)
        if rank == 0:
            torch.save({"mode": mode, "presence": presence, "m1": m1, "m2": m2, "grads1": grads1, "grads2": grads2,
                        "params": params}, f"{out_dir}/{name}.pt")
        worker.shutdown()


def test_lean_paths_shard_gradients_and_reference_and_change_no_result(tiny_model_dir, tmp_path):
    ports = [free_port() for _ in range(2)]
    mp.spawn(_ranks_main, args=(tiny_model_dir, ports, str(tmp_path)), nprocs=2, join=True)
    speed, lean = torch.load(tmp_path / "speed.pt"), torch.load(tmp_path / "lean.pt")

    assert speed["mode"] == {"lean": False, "reference_sharded": False}
    assert lean["mode"] == {"lean": True, "reference_sharded": True}
    # two steps x two micro-batches: the gradient shard exists after the first micro-batch only when lean
    assert speed["presence"] == [False, True, False, True]
    assert lean["presence"] == [True, True, True, True]

    assert lean["m2"]["metrics"]["actor/kl"] > 1e-9, "the second step must exercise the reference policy"
    for step in ("m1", "m2"):
        for key in ("actor/loss", "actor/kl", "actor/entropy", "actor/grad_norm", "actor/ratio_mean",
                    "actor/clip_fraction", "rollout/logprob_diff"):
            a, b = lean[step]["metrics"][key], speed[step]["metrics"][key]
            assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), f"{step} {key}: lean {a} vs speed {b}"
        assert not lean[step]["skipped"] and lean[step]["policy_version"] == speed[step]["policy_version"]
    assert_same_grads(lean["grads1"], speed["grads1"], "step 1: lean vs speed")
    assert_same_grads(lean["grads2"], speed["grads2"], "step 2: lean vs speed")
    assert_same_params(lean["params"], speed["params"], "after 2 steps: lean vs speed")
