"""``train.activation_checkpointing`` and ``train.cpu_offload`` on the FSDP2 train rank (in-process, tiny model): each
is in effect and changes no result.

- Activation checkpointing: every decoder layer of the policy checkpoints (and the frozen reference does not); the
  tensors the policy's forward keeps for its backward (counted with ``torch.autograd.graph.saved_tensors_hooks``, the
  mechanism autograd saves activations through) inside the decoder layers fall to (almost) nothing; one GRPO step
  gives the same loss, gradient norm and parameters as without it.
- CPU offload: every FSDP2 unit of the policy carries ``CPUOffloadPolicy`` (the reference none), its parameters,
  AdamW state is on the CPU; one GRPO step gives the same results as without it. (On a CPU rank
  nothing moves; what offload saves on a GPU is measured by ``scripts/gpu_check.sh`` where a GPU is lent.)
"""

from __future__ import annotations

import pytest
import torch

from cluster.in_process import LocalTrainer
from tests.local_runtime import local_spec
from train_workers.packing import pack_microbatch
from train_workers.sharding import decoder_layers

SEQUENCES, PROMPT, RESPONSE = 8, 24, 40


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (PROMPT,), generator=g).tolist() for _ in range(SEQUENCES)]
    responses = [torch.randint(3, vocab, (RESPONSE,), generator=g).tolist() for _ in range(SEQUENCES)]
    behaviour = [-torch.rand(RESPONSE, generator=g) for _ in range(SEQUENCES)]
    advantages = [1.0 if i % 2 else -1.0 for i in range(SEQUENCES)]
    return pack_microbatch(prompts, responses, advantages, behaviour, list(range(SEQUENCES)))


def _saved_bytes(engine, mb, layers) -> tuple[int, int]:
    """(all, inside the decoder ``layers``): bytes of the tensors autograd keeps for the backward of one policy
    forward (then dropped)."""
    totals, inside = [0, 0], [0]

    def pack(t):
        size = t.numel() * t.element_size()
        totals[0] += size
        totals[1] += size if inside[0] else 0
        return t

    def enter(module, args):
        inside[0] += 1

    def leave(module, args, output):
        inside[0] -= 1

    handles = [h for layer in layers for h in (layer.register_forward_pre_hook(enter),
                                               layer.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprobs, _ = engine.policy_forward(engine.inputs(mb))
    finally:
        for h in handles:
            h.remove()
    del logprobs
    return totals[0], totals[1]


def _offloaded(module) -> list[bool]:
    """Whether each FSDP2 unit (with parameters) of ``module`` carries ``CPUOffloadPolicy``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    return [isinstance(m._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
            for m in module.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group]


def _run(model_dir: str, out: str, **train) -> dict:
    spec = local_spec(model_dir, out, train={"num_threads": 1, "lr": 1e-3, **train},
                      algorithm={"kl_coef": 0.04})
    trainer = LocalTrainer(spec)
    trainer.start(model_dir)
    try:
        worker = trainer.worker
        mb = _batch(worker.policy.model.config.vocab_size)
        saved, in_layers = _saved_bytes(worker.engine, mb, decoder_layers(worker.policy))
        result = trainer.train_step([[mb]], SEQUENCES * RESPONSE, SEQUENCES)
        return {
            "saved": saved, "in_layers": in_layers, "metrics": result.metrics,
            "params": [p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                       for p in worker.policy.parameters()],
            "checkpointing": [layer.gradient_checkpointing for layer in decoder_layers(worker.policy)],
            "reference_checkpointing": [layer.gradient_checkpointing for layer in decoder_layers(worker.reference)],
            "offloaded": _offloaded(worker.policy),
            "state_devices": {v.device.type for s in worker.optimizer.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor)},
        }
    finally:
        trainer.shutdown()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("memory_knobs"))
    return {"off": _run(tiny_model_dir, out), "ac": _run(tiny_model_dir, out, activation_checkpointing=True),
            "offload": _run(tiny_model_dir, out, cpu_offload=True)}


def _same_step(a: dict, b: dict) -> None:
    for key in ("actor/loss", "actor/grad_norm", "actor/kl", "actor/entropy"):
        assert b["metrics"][key] == pytest.approx(a["metrics"][key], rel=1e-5, abs=1e-7), key
    for p, q in zip(a["params"], b["params"], strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_keeps_fewer_activations_and_the_same_step(runs):
    off, ac = runs["off"], runs["ac"]
    assert not any(off["checkpointing"]) and all(ac["checkpointing"]) and not any(ac["reference_checkpointing"])
    # the decoder layers keep (almost) nothing for the backward; the rest of the model (embedding, LM head) is as
    # before, so the whole forward keeps less by what the layers kept
    assert off["in_layers"] > 0 and ac["in_layers"] <= 0.05 * off["in_layers"], (ac["in_layers"], off["in_layers"])
    assert off["saved"] - ac["saved"] >= 0.9 * off["in_layers"], (ac["saved"], off["saved"], off["in_layers"])
    _same_step(off, ac)


def test_cpu_offload_puts_every_policy_unit_on_the_cpu_and_changes_no_result(runs):
    off, offload = runs["off"], runs["offload"]
    assert offload["offloaded"] and all(offload["offloaded"]) and not any(off["offloaded"])
    assert offload["state_devices"] == {"cpu"}
    _same_step(off, offload)
