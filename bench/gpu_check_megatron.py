"""Device-check section ``megatron``: the Megatron-core backend's bf16 train step next to FSDP2's, one GPU, TP = 1.

What runs, without Ray (``MegatronTrainWorker.init_distributed`` and ``FSDPTrainWorker.init_distributed`` import it,
and the device image has neither Ray nor pydantic): the worker's own building blocks, in the order ``_build`` uses
them. ``parallel_state.initialize_model_parallel(1, 1)`` over a world-size-1 group (NCCL; gloo in ``--dry-run``), a
``GPTModel`` from ``train_workers.megatron.config`` (``transformer_config(compute_dtype=bfloat16)``: float32 parameters,
``bf16=True``; local layer spec), its state dict converted from the same random HF Llama the FSDP2 side trains
(``convert.hf_to_megatron``), wrapped in ``policy.MegatronResponseLogprobs(compute_dtype=bfloat16)`` (bf16 casts of the
float32 parameters per forward, float32 logprobs). The FSDP2 side is ``bench.gpu_check_train``'s: the HF model in
``ResponseLogprobModel``, ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. A step is
what both workers do per micro-batch and per optimizer step: forward, ``grpo.losses.policy_loss`` (token-mean, clip
0.2/0.28), backward, ``clip_grad_norm_`` to 1 (at tp = 1 the Megatron worker's clip is the same L2 norm), AdamW.

Checked (PASS/FAIL): on the first step, before any update, the two backends' loss, per-token logprobs and gradient norm
agree within :data:`PARITY_TOL` (two bf16 implementations of the same float32 weights: different kernels and
summation orders, so bf16-sized differences), and the Megatron parameters and gradients are float32.
Measured: median step time over ``steps`` after ``warmup``, tokens/s (packed tokens, prompt + response), MFU and peak
memory for each backend.

Model (GPU): :data:`MODEL_0_5B` — a random Llama with hidden 1024, 24 layers, 16 query / 2 key-value heads (head dim
64), SwiGLU 5504, vocabulary 32,768, tied embeddings: 496.0 M parameters (462.5 M non-embedding). Batch: 16 sequences
× (256 prompt + 768 response) tokens, one packed micro-batch (as the ``throughput`` section). Megatron's local
attention runs on the right-padded [16, 1024] batch with a causal mask (``policy.py``: packed sequences need
Transformer Engine), FSDP2 on the packed row with the worker's packed attention.

MFU = model FLOPs / step time / :data:`bench.gpu_check_train.H200_BF16_PEAK_FLOPS` (989e12 FLOP/s: H200 SXM dense bf16,
NVIDIA datasheet). Two model-FLOP counts are reported: ``mfu_6nt`` = 6·N·tokens (N all parameters, the tied embedding
once: the common "6ND" convention, which over-counts the LM head at prompt positions and ignores attention's O(l²)
term) and ``mfu`` = ``bench.gpu_check_train.model_flops`` (6·N_non-embedding·tokens + 6·H·V·response tokens +
6·layers·d_attn·Σl², as the ``throughput`` section).

SKIP (with the reason) when megatron-core does not import: the device image does not have it; carry its wheel
(``scripts/gpu_check.sh`` header). ``--dry-run``: the tiny model on CPU over gloo, with the test-only CPU shims of
``tests/megatron_cpu.py`` (megatron-core 0.16.1's three CUDA assumptions; the backend itself carries none).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from bench.gpu_check import Context, Result, importable, verdict
from bench.gpu_check_train import (H200_BF16_PEAK_FLOPS, SIZES, TEMPERATURE, _free_port, build_policy, full,
                                   init_group, llama_config, loss_backward, make_batch, model_flops, old_logprobs,
                                   packed_attention, shard, timed_train_steps)

#: The GPU model: 0.5B Llama-shaped, vocabulary 32k (``bench.gpu_check_train.SIZES``).
MODEL_0_5B = "0.5b-v32k"
#: Megatron bf16 vs FSDP2 bf16 on the same float32 weights, first step: loss (relative), per-token logprobs (max
#: absolute, nats), gradient norm before clipping (relative). bf16 keeps 8 significant bits (≈ 0.4 % per rounding).
PARITY_TOL = {"loss_rel": 2e-2, "logprob_max_abs": 5e-2, "grad_norm_rel": 5e-2}


def megatron_policy(hf_policy, size: str, device: torch.device, compute_dtype: torch.dtype):
    """``MegatronResponseLogprobs`` around a TP = 1 ``GPTModel`` holding ``hf_policy``'s weights (float32 copies),
    computing in ``compute_dtype``; Megatron's parallel state must be initialised.

    Raises:
        RuntimeError: the converted state dict does not fill the GPTModel (names the missing/unexpected keys).
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    from train_workers.megatron.config import check_megatron_layout, gpt_model_kwargs, transformer_config
    from train_workers.megatron.convert import hf_to_megatron
    from train_workers.megatron.policy import MegatronResponseLogprobs

    layout = check_megatron_layout({**llama_config(size).to_dict(), "architectures": ["LlamaForCausalLM"]})
    config = transformer_config(layout, compute_dtype=compute_dtype, use_cpu_initialization=device.type != "cuda")
    model = GPTModel(**gpt_model_kwargs(layout, config, parallel_output=True))
    hf_state = {k: v.detach().float() for k, v in hf_policy.model.state_dict().items()}
    missing, unexpected = model.load_state_dict(hf_to_megatron(hf_state, layout), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"converted state dict: missing {missing[:3]}, unexpected {list(unexpected)[:3]}")
    model.to(device, torch.float32)
    return MegatronResponseLogprobs(model, layout.vocab_size, TEMPERATURE, compute_dtype=compute_dtype)


def _timed_steps(model, mb, old, device: torch.device, n_tok: int, warmup: int, steps: int, flops: dict) -> dict:
    """``warmup`` + ``steps`` train steps (zero_grad, forward + loss + backward, clip to 1, AdamW lr 1e-6) of
    ``model``; the median step's milliseconds, tokens/s, MFU (both FLOP counts) and peak CUDA memory."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    cuda = device.type == "cuda"
    step_s, loss = timed_train_steps(model, optimizer, mb, old, device, n_tok, warmup, steps)
    row = {"step_ms_median": round(step_s * 1e3, 1), "tokens_per_s": round(mb.num_tokens / step_s), "loss": loss}
    if cuda:
        row["mfu_6nt"] = round(6 * flops["params_total"] * flops["tokens"] / step_s / H200_BF16_PEAK_FLOPS, 4)
        row["mfu"] = round(flops["flops"] / step_s / H200_BF16_PEAK_FLOPS, 4)
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        torch.cuda.empty_cache()
    return row


def section_megatron(ctx: Context) -> Result:
    """Megatron-core bf16 (TP = 1) vs FSDP2 bf16: first-step parity, then step time, tokens/s and MFU of each."""
    if error := importable("megatron.core"):
        return Result("SKIP", f"megatron-core does not import ({error}); carry its wheel: scripts/gpu_check.sh header")
    from megatron.core import parallel_state as ps
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if ctx.dry_run:
        from tests.megatron_cpu import install_cpu_shims

        install_cpu_shims()
    device = init_group(ctx, 0, 1, _free_port())
    size = "tiny" if ctx.dry_run else MODEL_0_5B
    lengths = [(16, 16)] * 4 if ctx.dry_run else [(256, 768)] * 16
    warmup, steps = (1, 2) if ctx.dry_run else (2, 5)
    bf16 = torch.bfloat16
    flops = model_flops(size, lengths)
    attention = packed_attention(ctx, bf16)
    numbers: dict = {"model": size, "config": SIZES[size], "tie_word_embeddings": True, "tp": 1,
                     "batch": f"{len(lengths)} sequences × ({lengths[0][0]} prompt + {lengths[0][1]} response) tokens",
                     "precision": "fp32 params + AdamW, bf16 compute, fp32 logprobs/loss (both backends)",
                     **flops, "peak_flops": H200_BF16_PEAK_FLOPS if device.type == "cuda" else None,
                     "fsdp_attention": attention, "megatron_attention": "local spec, right-padded + causal mask",
                     "tolerances": PARITY_TOL}
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        if device.type == "cuda":
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)
        fsdp = build_policy(size, attention, device)  # float32, seed 0
        megatron = megatron_policy(fsdp, size, device, bf16)
        mb = make_batch(SIZES[size]["vocab_size"], lengths)
        old = old_logprobs(fsdp, mb, device)
        shard(fsdp, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32))
        n_tok = int(mb.response_mask.sum())
        losses, logprobs, norms, dtypes = {}, {}, {}, []
        for name, model in (("fsdp", fsdp), ("megatron", megatron)):
            losses[name], logprobs[name] = loss_backward(model, mb, old, device, n_tok)
            norms[name] = float(full(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
            if name == "megatron":
                dtypes = sorted({str(t.dtype) for p in model.parameters() for t in (p, p.grad) if t is not None})
            model.zero_grad(set_to_none=True)
        errs = {"loss_rel": abs(losses["megatron"] - losses["fsdp"]) / max(abs(losses["fsdp"]), 1e-12),
                "logprob_max_abs": (logprobs["megatron"].float() - logprobs["fsdp"].float()).abs().max().item(),
                "grad_norm_rel": abs(norms["megatron"] - norms["fsdp"]) / max(norms["fsdp"], 1e-12)}
        numbers.update(first_step={"loss": losses, "grad_norm": norms,
                                   **{k: float(f"{v:.3g}") for k, v in errs.items()}},
                       megatron_param_and_grad_dtypes=dtypes)
        for name, model in (("fsdp", fsdp), ("megatron", megatron)):
            numbers[name] = _timed_steps(model, mb, old, device, n_tok, warmup, steps, flops)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    failures = [f"{k} {errs[k]:.3g} > {tol:g}" for k, tol in PARITY_TOL.items() if not errs[k] <= tol]
    if dtypes != ["torch.float32"]:
        failures.append(f"Megatron parameters/gradients are {dtypes}, expected float32 master copies")
    for name in ("fsdp", "megatron"):
        row = numbers[name]
        if not math.isfinite(row["loss"]):
            failures.append(f"{name}: loss {row['loss']}")
        if device.type == "cuda" and not 0 < row["mfu"] < 1:
            failures.append(f"{name}: MFU {row['mfu']} outside (0, 1): FLOPs formula or timing wrong")
    if device.type == "cuda":
        numbers["megatron_vs_fsdp_tokens_per_s"] = round(numbers["megatron"]["tokens_per_s"]
                                                         / numbers["fsdp"]["tokens_per_s"], 3)
    return verdict(failures, numbers, "Megatron bf16 step matches FSDP2 bf16 at the first step; both timed")
