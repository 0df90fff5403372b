"""The train worker's speed-ups change no result, and a non-finite step is skipped on every rank.

1. Equal results (issue 8): two gloo ranks take two GRPO steps (the second with a nonzero KL to the reference policy)
   once with the current code — fused chunked LM head + log-softmax, reference policy replicated and run under
   inference_mode, policy kept unsharded with gradients accumulated locally until the last micro-batch — and once
   the way the worker computed before: FSDP2 defaults (sharded reference, reshard after forward, a reduce-scatter
   per micro-batch) and the unfused head (full [M, V] logits, ``logprobs_from_logits``, ``entropy_from_logits``).
   Loss, KL, entropy, grad norm, the clipped gradients of both steps and the parameters after them must agree
   within float32 tolerance.
2. The lean CPU paths that ``train.activation_checkpointing`` turns on (issue 29): the rank reduce-scatters its
   gradients after every micro-batch (it holds a gradient shard, not a full-size gradient) and shards the frozen
   reference policy. The mode is in effect (the
   reference is an FSDP2 module; the sharded parameters hold their gradient after the first of a rank's two
   micro-batches, where the speed paths leave them empty until the last; the decoder layers are resharded after
   every forward and backward, where the speed paths keep them unsharded until the last backward), and both steps
   give the same metrics, clipped gradients and parameters as the speed paths without checkpointing.
3. NaN/Inf skip (issue 7): after a normal step, a NaN loss forced on rank 1 only, then an Inf gradient forced on
   rank 0 only, each skip the update on both ranks: parameters, AdamW state and policy version unchanged,
   ``actor/update_skipped`` 1.0 with the offending metric named; the next normal step updates again.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
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
from weight_sync.group import free_ports

MICROBATCHES = [[[0, 1], [2]], [[3, 4, 5], []]]  # rank 0: two micro-batches; rank 1: one + the placeholder


def _unfused_forward(self, input_ids, position_ids, logit_positions, targets, with_entropy: bool = True):
    """``ResponseLogprobModel.forward`` as it was before the fused head: full logits, then log-softmax."""
    from grpo.logprobs import entropy_from_logits, logprobs_from_logits

    backbone = self.model.get_decoder()
    head = self.model.get_output_embeddings()
    hidden = backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    logits = head(hidden[0, logit_positions]).float()
    logprobs = logprobs_from_logits(logits, targets, self.temperature).clone()
    if not with_entropy:
        return logprobs, None
    with torch.no_grad():
        entropy = entropy_from_logits(logits.detach(), self.temperature, chunk_size=self.logit_chunk_size)
    return logprobs, entropy


def _adam_state(worker) -> dict[str, torch.Tensor]:
    from train_workers.sharding import full_tensor

    out = {}
    for i, p in enumerate(worker.optimizer.param_groups[0]["params"]):
        for key, value in worker.optimizer.state.get(p, {}).items():
            out[f"{i}.{key}"] = full_tensor(value).detach().clone() if value.dim() else value.detach().clone()
    return out


def _worker(rank: int, port: int, model_dir: str, fast: bool, kl_coef: float = 0.04, cls=None,
            checkpointing: bool = False):
    from cluster.spec import AlgorithmSpec, TrainSpec
    from train_workers.fsdp_worker import FSDPTrainWorker

    train = TrainSpec(world_size=2, num_threads=1, lr=1e-4, max_grad_norm=1.0, timeout_s=120,
                      activation_checkpointing=checkpointing)
    worker = (cls or FSDPTrainWorker)(rank, 2, model_dir, train, AlgorithmSpec(kl_coef=kl_coef), TEMPERATURE,
                                      MAX_RESPONSE_TOKENS, dtype="float32", seed=0)
    worker._cpu_fast_paths = fast
    worker.init_distributed("127.0.0.1", port)
    return worker


def _record_grad_presence(worker, into: list, sharded: list) -> None:
    """After each micro-batch's backward, append to ``into`` whether every trained (sharded) parameter holds a
    gradient; after each policy forward and each backward, append to ``sharded`` whether the decoder layers' (the
    non-root FSDP2 units') parameters are their sharded DTensors, i.e. whether the layers were resharded."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    backward, forward = worker.engine.backward, worker.engine.policy_forward
    layers = [m for m in worker.policy.modules() if isinstance(m, FSDPModule) and m is not worker.policy]

    def layers_sharded() -> bool:
        return all(isinstance(p, DTensor) for layer in layers for p in layer.parameters())

    def recording_forward(args):
        out = forward(args)
        sharded.append(("forward", layers_sharded()))
        return out

    def recording_backward(loss):
        backward(loss)
        into.append(all(p.grad is not None for p in worker.optimizer.param_groups[0]["params"]))
        sharded.append(("backward", layers_sharded()))

    worker.engine.backward, worker.engine.policy_forward = recording_backward, recording_forward


def _step(worker, rank: int) -> dict:
    """One train step; its ``TrainResult`` as a dict (``policy_version``, ``skipped``, ``skip_reason``, ``metrics``)."""
    _, responses, _ = make_batch()
    return asdict(worker.train_step([pack(idx) for idx in MICROBATCHES[rank]], sum(len(r) for r in responses), N))


def _ranks_main(rank: int, model_dir: str, ports: list[int], out_dir: str):
    from torch.distributed.fsdp import FSDPModule

    from train_workers import policy

    torch.set_num_threads(1)
    fused_forward = policy.ResponseLogprobModel.forward
    runs = (("fast", True, False, ports[0]), ("before", False, False, ports[1]), ("lean", True, True, ports[3]))
    for name, fast, checkpointing, port in runs:
        policy.ResponseLogprobModel.forward = fused_forward if fast else _unfused_forward
        worker = _worker(rank, port, model_dir, fast, checkpointing=checkpointing)
        mode = {"lean": worker.engine.lean, "reference_sharded": isinstance(worker.reference, FSDPModule)}
        presence: list[bool] = []
        sharded: list[tuple[str, bool]] = []
        _record_grad_presence(worker, presence, sharded)
        grads1, grads2 = {}, {}
        plain_step = worker.optimizer.step
        _capture_grads(worker, grads1)
        m1 = _step(worker, rank)
        worker.optimizer.step = plain_step
        _capture_grads(worker, grads2)
        m2 = _step(worker, rank)
        params = _full_params(worker)
        if rank == 0:
            torch.save({"mode": mode, "presence": presence, "sharded": sharded, "m1": m1, "m2": m2, "grads1": grads1,
                        "grads2": grads2, "params": params}, f"{out_dir}/{name}.pt")
        worker.shutdown()
    policy.ResponseLogprobModel.forward = fused_forward

    from tests.faults import NonFiniteStepWorker

    worker = _worker(rank, ports[2], model_dir, fast=True, cls=NonFiniteStepWorker)
    runs = {"normal": _step(worker, rank)}
    for key, poisoned_rank, metric in (("nan_loss", 1, "loss"), ("inf_grad", 0, "grad_norm")):
        before, adam = _full_params(worker), _adam_state(worker)
        if rank == poisoned_rank:
            worker.fail_next_step(metric)
        runs[key] = _step(worker, rank)
        runs[key + "_params_same"] = all(torch.equal(before[n], p) for n, p in _full_params(worker).items())
        runs[key + "_adam_same"] = all(torch.equal(adam[k], v) for k, v in _adam_state(worker).items())
    runs["after"] = _step(worker, rank)
    runs["version"] = worker.policy_version
    torch.save(runs, f"{out_dir}/nan_rank{rank}.pt")
    worker.shutdown()


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """The folder holding every run's results: fast, before, lean (one spawn of two ranks) and the NaN/Inf runs."""
    out = tmp_path_factory.mktemp("fast_paths")
    ports = free_ports(4)
    mp.spawn(_ranks_main, args=(tiny_model_dir, ports, str(out)), nprocs=2, join=True)
    return out


def _assert_same_two_steps(run: dict, ref: dict, rtol: float, name: str, ref_name: str) -> None:
    """``run``'s two steps equal ``ref``'s: the step metrics (relative ``rtol``), not skipped, the same policy version,
    the clipped gradients of both steps and the parameters after them."""
    for step in ("m1", "m2"):
        for key in ("actor/loss", "actor/kl", "actor/entropy", "actor/grad_norm", "actor/ratio_mean",
                    "actor/clip_fraction", "rollout/logprob_diff"):
            a, b = run[step]["metrics"][key], ref[step]["metrics"][key]
            assert abs(a - b) <= rtol * max(1.0, abs(b)), f"{step} {key}: {name} {a} vs {ref_name} {b}"
        assert not run[step]["skipped"] and run[step]["policy_version"] == ref[step]["policy_version"]
    assert_same_grads(run["grads1"], ref["grads1"], f"step 1: {name} vs {ref_name}")
    assert_same_grads(run["grads2"], ref["grads2"], f"step 2: {name} vs {ref_name}")
    assert_same_params(run["params"], ref["params"], f"after 2 steps: {name} vs {ref_name}")


def test_fast_paths_equal_before_and_nonfinite_steps_are_skipped(trained):
    tmp_path = trained
    fast, before = torch.load(tmp_path / "fast.pt"), torch.load(tmp_path / "before.pt")
    assert fast["m2"]["metrics"]["actor/kl"] > 1e-9, "the second step must exercise the reference policy"
    _assert_same_two_steps(fast, before, 1e-5, "fast", "before")
    for step in ("m1", "m2"):
        assert fast[step]["metrics"]["actor/update_skipped"] == 0.0 and fast[step]["skip_reason"] == ""
    assert fast["m2"]["policy_version"] == 2

    for rank in (0, 1):
        runs = torch.load(tmp_path / f"nan_rank{rank}.pt")
        assert runs["normal"]["metrics"]["actor/update_skipped"] == 0.0 and runs["normal"]["policy_version"] == 1
        for key, metric in (("nan_loss", "actor/loss"), ("inf_grad", "actor/grad_norm")):
            r = runs[key]
            assert r["metrics"]["actor/update_skipped"] == 1.0, (rank, key, r["metrics"]["actor/update_skipped"])
            assert r["skipped"] and r["skip_reason"] == metric, (rank, key, r["skip_reason"])
            assert r["policy_version"] == 1, (rank, key)
            assert runs[key + "_params_same"] and runs[key + "_adam_same"], (rank, key)
        assert runs["after"]["metrics"]["actor/update_skipped"] == 0.0 and runs["after"]["policy_version"] == 2
        assert runs["version"] == 2


def test_lean_paths_shard_gradients_and_reference_and_change_no_result(trained):
    speed, lean = torch.load(trained / "fast.pt"), torch.load(trained / "lean.pt")

    assert speed["mode"] == {"lean": False, "reference_sharded": False}
    assert lean["mode"] == {"lean": True, "reference_sharded": True}
    # two steps x two micro-batches: the gradient shard exists after the first micro-batch only when lean
    assert speed["presence"] == [False, True, False, True]
    assert lean["presence"] == [True, True, True, True]
    # the speed paths keep the layers unsharded from a step's first forward to its last backward; lean reshards them
    # after every forward and backward (FSDP2's defaults), so a rank holds one layer's full parameters at a time
    per_step = [("forward", False), ("backward", False), ("forward", False), ("backward", True)]
    assert speed["sharded"] == per_step * 2, speed["sharded"]
    assert lean["sharded"] == [(phase, True) for phase, _ in per_step] * 2, lean["sharded"]

    assert lean["m2"]["metrics"]["actor/kl"] > 1e-9, "the second step must exercise the reference policy"
    _assert_same_two_steps(lean, speed, 1e-6, "lean", "speed")
