"""Device-check sections for the FSDP2 train step: parity, bf16 mixed precision, two ranks on one GPU, throughput.

The step is the project's model path without Ray: an HF Llama (random weights) inside
``train_workers.policy.ResponseLogprobModel`` (fused LM head at the response positions only), sharded in torchtitan's
order (``fully_shard`` per decoder layer, then the root, as ``train_workers.fsdp_worker`` does), one packed micro-batch
(``train_workers.packing.pack_microbatch``), ``grpo.losses.policy_loss`` (token-mean, clip 0.2/0.28), the loss
multiplied by the world size as the worker does, ``clip_grad_norm_`` and AdamW. ``FSDPTrainWorker`` itself cannot run
without Ray (``init_distributed`` imports it), so it is not used here.

The attention is the one ``FSDPTrainWorker`` picks for packed rows (:func:`packed_attention`): ``flash_attention_2`` on
CUDA when flash-attn is installed (and, after the mixed-precision change, the compute dtype is 16-bit), else
``sdpa`` on CUDA before that change and ``packed_varlen_sdpa`` after it and on CPU.

Behaviour (old) logprobs are the fp32 model's own plus fixed noise (std 0.1), so importance ratios differ from 1, some
tokens clip, and the loss depends on the weights.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from bench.gpu_check import Context, Result, verdict
from bench.gpu_check_kernels import rel_err, strict_fp32

#: Model shapes (LlamaConfig fields). "0.5b": Qwen2.5-0.5B's dimensions in a Llama (no qkv bias), 494M parameters.
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, vocab_size=8192),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64, vocab_size=151_936),
    # the megatron section's (bench/gpu_check_megatron.py): 0.5B Llama-shaped with a 32k vocabulary, 496.0M parameters
    "0.5b-v32k": dict(hidden_size=1024, intermediate_size=5504, num_hidden_layers=24, num_attention_heads=16,
                      num_key_value_heads=2, head_dim=64, vocab_size=32_768),
}
#: H200 SXM dense bf16 tensor-core peak, FLOP/s (NVIDIA datasheet; 1979 with 2:4 sparsity).
H200_BF16_PEAK_FLOPS = 989e12
TEMPERATURE = 0.8
CLIP = dict(clip_eps_low=0.2, clip_eps_high=0.28, loss_agg="token-mean")
#: fp32 FSDP2 vs unsharded: loss (relative), gradients (per tensor max|Δ| / max|ref|), parameters after AdamW (abs).
PARITY_TOL = {"loss_rel": 1e-5, "grad": 1e-4, "param_abs": 1e-5}
#: bf16 mixed precision vs fp32 (bf16 keeps 8 significant bits, ≈ 0.4 % per rounding).
MP_TOL = {"loss_rel": 2e-2, "logprob_max_abs": 5e-2, "grad_cosine_min": 0.99, "grad_norm_rel": 5e-2,
          "update_sign_agreement_min": 0.9, "update_kept_min": 0.95}


def llama_config(size: str):
    """The LlamaConfig of ``SIZES[size]`` (tied embeddings, as SmolLM2 and Qwen2.5-0.5B)."""
    from transformers import LlamaConfig

    return LlamaConfig(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6)


def packed_attention(ctx: Context, compute_dtype: torch.dtype = torch.float32) -> str:
    """The attention ``FSDPTrainWorker`` uses for packed rows on this device at ``compute_dtype``
    (``train_workers.packing.packed_attention``)."""
    from train_workers.packing import packed_attention as choose

    return choose(ctx.device == "cuda", compute_dtype)


def build_policy(size: str, attention: str, device: torch.device, seed: int = 0):
    """A float32 ``ResponseLogprobModel`` around a random Llama of ``SIZES[size]`` on ``device``."""
    from transformers import AutoModelForCausalLM

    from train_workers.policy import ResponseLogprobModel

    torch.manual_seed(seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(llama_config(size), attn_implementation=attention,
                                              dtype=torch.float32)
    hf.config.use_cache = False
    return ResponseLogprobModel(hf, TEMPERATURE)


def shard(model, mp_policy=None) -> None:
    """FSDP2 in torchtitan's order (each decoder layer, then the root), optionally with a MixedPrecisionPolicy."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model.model.get_decoder().layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def init_group(ctx: Context, rank: int, world: int, port: int) -> torch.device:
    """Join a ``world``-rank group (NCCL with the device bound at init on CUDA, gloo on CPU); returns the device."""
    device = torch.device("cuda", 0) if ctx.device == "cuda" else torch.device("cpu")
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # eager NCCL init: a refused layout fails here, not in a later collective
    dist.init_process_group(ctx.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60), **kwargs)
    return device


def make_batch(vocab: int, lengths: list[tuple[int, int]], seed: int = 0, indices: list[int] | None = None):
    """One packed micro-batch of random (prompt, response) token pairs with advantages ±1, ±0.5, ... ."""
    from train_workers.packing import pack_microbatch

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (p,), generator=gen).tolist() for p, _ in lengths]
    responses = [torch.randint(0, vocab, (r,), generator=gen).tolist() for _, r in lengths]
    advantages = [(1.0 if i % 2 == 0 else -1.0) * (1 + i % 3) / 2 for i in range(len(lengths))]
    indices = list(range(len(lengths))) if indices is None else indices
    return pack_microbatch([prompts[i] for i in indices], [responses[i] for i in indices],
                           [advantages[i] for i in indices], [torch.zeros(len(responses[i])) for i in indices],
                           indices)


def _args(mb, device):
    return (mb.input_ids.to(device), mb.position_ids.to(device), mb.logit_positions.to(device),
            mb.targets.to(device))


def old_logprobs(model, mb, device, seed: int = 3) -> torch.Tensor:
    """Behaviour logprobs [M] (flat, packed order) for ``mb``: the model's own plus N(0, 0.1²) noise."""
    with torch.no_grad():
        lp, _ = model(*_args(mb, device), with_entropy=False)
    noise = torch.randn(lp.shape, generator=torch.Generator().manual_seed(seed)).to(device)
    return (lp.float() + 0.1 * noise).detach()


def loss_backward(model, mb, old_flat, device, num_tokens: int, world: int = 1):
    """Forward + backward of one micro-batch; returns (loss float, logprobs [M] float32 detached)."""
    from grpo.losses import policy_loss

    lp_flat, entropy_flat = model(*_args(mb, device))
    loss, _ = policy_loss(mb.to_padded(lp_flat), mb.to_padded(old_flat), mb.advantages.to(device),
                          mb.response_mask.to(device), entropy=mb.to_padded(entropy_flat), num_tokens=num_tokens,
                          **CLIP)
    (loss * world).backward()
    return float(loss.detach()), lp_flat.detach()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective) or the tensor itself, detached, float32."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters()}


def params(model) -> dict[str, torch.Tensor]:
    return {n: full(p).clone() for n, p in model.named_parameters()}


def optimizer_step(model, lr: float) -> float:
    """Clip the gradient norm to 1 and take one AdamW step (no weight decay); returns the pre-clip norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0).step()
    return float(full(norm))


def _grad_diff(a: dict, b: dict) -> float:
    """Worst per-tensor max|a − b| / max|b| over the parameters."""
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in b)


def _free_port() -> int:
    from weight_sync.group import free_port

    return free_port("127.0.0.1")


def _lengths(ctx: Context) -> list[tuple[int, int]]:
    return [(5, 4), (3, 8), (8, 2), (4, 6), (6, 3), (2, 5)] if ctx.dry_run else \
        [(64, 96), (17, 200), (128, 31), (40, 150), (90, 64), (33, 120)]


# ------------------------------------------------------------------------------------------------------ sections
def section_fsdp_step(ctx: Context) -> Result:
    """World size 1 on NCCL: loss, gradients and AdamW update of the FSDP2 model equal the unsharded model's."""
    strict_fp32()
    device = init_group(ctx, 0, 1, _free_port())
    try:
        size, attention = ("tiny" if ctx.dry_run else "small"), packed_attention(ctx)
        reference = build_policy(size, attention, device)
        policy = copy.deepcopy(reference)
        shard(policy)
        mb = make_batch(SIZES[size]["vocab_size"], _lengths(ctx))
        old = old_logprobs(reference, mb, device)
        n_tok = int(mb.response_mask.sum())
        t0 = time.perf_counter()
        loss, _ = loss_backward(policy, mb, old, device, n_tok)
        loss_ref, _ = loss_backward(reference, mb, old, device, n_tok)
        g, g_ref = grads(policy), grads(reference)
        before = params(reference)
        norm, norm_ref = optimizer_step(policy, 1e-4), optimizer_step(reference, 1e-4)
        after, after_ref = params(policy), params(reference)
        seconds = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()
    errs = {"loss_rel": abs(loss - loss_ref) / max(abs(loss_ref), 1e-12), "grad": _grad_diff(g, g_ref),
            "param_abs": max((after[n] - after_ref[n]).abs().max().item() for n in after)}
    moved = max((after[n] - before[n]).abs().max().item() for n in after)
    numbers = {"model": size, "attention": attention, "backend": ctx.backend, "tokens": mb.num_tokens,
               "loss": loss, "loss_unsharded": loss_ref, "grad_norm": norm, "grad_norm_unsharded": norm_ref,
               **{k: float(f"{v:.3g}") for k, v in errs.items()}, "max_param_move": float(f"{moved:.3g}"),
               "tolerances": PARITY_TOL, "seconds": round(seconds, 2)}
    failures = [f"{k} {errs[k]:.3g} > {tol:g}" for k, tol in PARITY_TOL.items() if not errs[k] <= tol]
    if not (math.isfinite(loss) and norm > 0 and moved > 5e-5):
        failures.append(f"no real step: loss {loss}, grad norm {norm}, largest move {moved:.3g}")
    return verdict(failures, numbers, "FSDP2 step equals the unsharded step")


def section_mixed_precision(ctx: Context) -> Result:
    """FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` vs FSDP2 fp32, same weights and batch:
    fp32 master parameters and gradients, loss/logprobs/gradient agreement, and a 5e-6 AdamW update that a pure-bf16
    parameter would round away is kept."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    strict_fp32()
    device = init_group(ctx, 0, 1, _free_port())
    try:
        size, attention = ("tiny" if ctx.dry_run else "small"), packed_attention(ctx)
        fp32 = build_policy(size, attention, device)
        mixed = copy.deepcopy(fp32)
        mb = make_batch(SIZES[size]["vocab_size"], _lengths(ctx))
        old = old_logprobs(fp32, mb, device)
        shard(fp32)
        shard(mixed, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        n_tok = int(mb.response_mask.sum())
        loss32, lp32 = loss_backward(fp32, mb, old, device, n_tok)
        loss16, lp16 = loss_backward(mixed, mb, old, device, n_tok)
        dtypes = {str(p.dtype) for p in mixed.parameters()} | {str(p.grad.dtype) for p in mixed.parameters()}
        g32, g16 = grads(fp32), grads(mixed)
        before = params(mixed)
        lr = 5e-6
        optimizer_step(fp32, lr)
        optimizer_step(mixed, lr)
        d32 = torch.cat([(full(p) - before[n]).flatten() for n, p in fp32.named_parameters()])
        d16 = torch.cat([(full(p) - before[n]).flatten() for n, p in mixed.named_parameters()])
        flat_before = torch.cat([before[n].flatten() for n, _ in mixed.named_parameters()])
    finally:
        dist.destroy_process_group()
    flat32, flat16 = torch.cat([g.flatten() for g in g32.values()]), torch.cat([g.flatten() for g in g16.values()])
    moved32 = d32 != 0
    lost_bf16 = (flat_before + d32).to(torch.bfloat16) == flat_before.to(torch.bfloat16)
    m = {"loss_rel": abs(loss16 - loss32) / max(abs(loss32), 1e-12),
         "logprob_max_abs": (lp16.float() - lp32).abs().max().item(),
         "grad_cosine": torch.nn.functional.cosine_similarity(flat16.double(), flat32.double(), dim=0).item(),
         "grad_norm_rel": rel_err(flat16.norm(), flat32.norm()),
         "grad_cosine_worst_tensor": min(torch.nn.functional.cosine_similarity(
             g16[n].flatten().double(), g32[n].flatten().double(), dim=0).item() for n in g32),
         "update_sign_agreement": (torch.sign(d16) == torch.sign(d32))[moved32].float().mean().item(),
         "update_kept": (d16 != 0)[moved32].float().mean().item()}
    numbers = {"model": size, "attention": attention, "loss_fp32": loss32, "loss_bf16": loss16,
               "param_and_grad_dtypes": sorted(dtypes), "lr": lr,
               **{k: float(f"{v:.4g}") for k, v in m.items()},
               "update_lost_if_params_were_bf16": float(f"{lost_bf16[moved32].float().mean().item():.4g}"),
               "tolerances": MP_TOL}
    failures = [f"{k} {m[k]:.3g} > {MP_TOL[k]:g}" for k in ("loss_rel", "logprob_max_abs", "grad_norm_rel")
                if not m[k] <= MP_TOL[k]]
    failures += [f"{k} {m[k.removesuffix('_min')]:.4g} < {MP_TOL[k]:g}" for k in
                 ("grad_cosine_min", "update_sign_agreement_min", "update_kept_min")
                 if not m[k.removesuffix("_min")] >= MP_TOL[k]]
    if dtypes != {"torch.float32"}:
        failures.append(f"sharded parameters/gradients are {sorted(dtypes)}, expected float32 master copies")
    return verdict(failures, numbers, "bf16 compute with fp32 master weights matches fp32 within tolerance")


def model_flops(size: str, lengths: list[tuple[int, int]]) -> dict:
    """Model FLOPs of one train step (forward + backward) for ``SIZES[size]`` on packed sequences (prompt, response).

    6·N·L for the decoder (N = non-embedding parameters: attention, MLP and norms; L = packed tokens)
    + 6·H·V·M for the LM head, applied at the M response positions only (fused head)
    + 6·n_layers·(n_heads·head_dim)·Σ l_i² for causal attention scores and values (PaLM's 12·n_layers·d_attn·l² per
      sequence, halved for the causal mask).
    Recomputing logit chunks in the backward (+2·H·V·M when M > the chunk size) is not counted: MFU counts model FLOPs.
    """
    c = SIZES[size]
    h, n_layers, d_attn = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"] * c["head_dim"]
    d_kv = c["num_key_value_heads"] * c["head_dim"]
    per_layer = h * d_attn * 2 + h * d_kv * 2 + 3 * h * c["intermediate_size"] + 2 * h
    n_body = n_layers * per_layer + h
    tokens = sum(p + r for p, r in lengths)
    responses = sum(r for _, r in lengths)
    attention = 6 * n_layers * d_attn * sum((p + r) ** 2 for p, r in lengths)
    return {"params_non_embedding": n_body, "params_total": n_body + c["vocab_size"] * h, "tokens": tokens,
            "response_tokens": responses,
            "flops": 6 * n_body * tokens + 6 * h * c["vocab_size"] * responses + attention,
            "attention_flops": attention}


def timed_train_steps(model, optimizer, mb, old, device: torch.device, n_tok: int, warmup: int,
                      steps: int) -> tuple[float, float]:
    """``warmup`` + ``steps`` train steps of ``model`` (zero_grad, :func:`loss_backward`, clip to 1,
    ``optimizer.step()``), CUDA-synchronised around each on a GPU, whose peak-memory counter is reset first.

    Returns:
        (median seconds of the timed steps, the last step's loss).
    """
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], float("nan")
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss, _ = loss_backward(model, mb, old, device, n_tok)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], loss


def _time_steps(size: str, attention: str, lengths, device: torch.device, warmup: int, steps: int,
                flops: float) -> dict:
    """Build the bf16-mixed-precision FSDP2 model and time ``steps`` train steps after ``warmup``; median step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = build_policy(size, attention, device)
    shard(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    mb = make_batch(SIZES[size]["vocab_size"], lengths)
    old = old_logprobs(model, mb, device)
    n_tok = int(mb.response_mask.sum())
    cuda = device.type == "cuda"
    step_s, loss = timed_train_steps(model, optimizer, mb, old, device, n_tok, warmup, steps)
    row = {"step_ms_median": round(step_s * 1e3, 1), "tokens_per_s": round(mb.num_tokens / step_s),
           "achieved_tflops": round(flops / step_s / 1e12, 1), "loss": loss}
    if cuda:
        row["mfu"] = round(flops / step_s / H200_BF16_PEAK_FLOPS, 4)
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return row


def section_throughput(ctx: Context) -> Result:
    """Tokens/s and MFU of the FSDP2 bf16-mixed-precision train step (forward, backward, clip, AdamW) of the 0.5B
    Llama-shaped model, world size 1, one packed micro-batch per step, for each packed attention available."""
    from train_workers.packing import register_varlen_sdpa

    device = init_group(ctx, 0, 1, _free_port())
    size = "tiny" if ctx.dry_run else "0.5b"
    lengths = [(16, 16)] * 4 if ctx.dry_run else [(256, 768)] * 16
    warmup, steps = (1, 2) if ctx.dry_run else (2, 5)
    flops = model_flops(size, lengths)
    worker_attention = packed_attention(ctx, torch.bfloat16)
    # the worker's choice first; on CUDA also per-sequence SDPA and transformers' dense block-diagonal-mask SDPA
    attentions = list(dict.fromkeys([worker_attention] + ([] if ctx.dry_run else [register_varlen_sdpa(), "sdpa"])))
    numbers: dict = {"model": size, "config": SIZES[size], "tie_word_embeddings": True,
                     "batch": f"{len(lengths)} sequences × ({lengths[0][0]} prompt + {lengths[0][1]} response) tokens",
                     "mixed_precision": "param bf16, reduce fp32, AdamW fp32", **flops,
                     "flops_formula": "6·N_non_embedding·tokens + 6·H·V·response_tokens + 6·layers·d_attn·Σl²",
                     "peak_flops": H200_BF16_PEAK_FLOPS if device.type == "cuda" else None,
                     "worker_attention_here": worker_attention}
    failures = []
    try:
        for attention in attentions:
            try:
                numbers[f"attention={attention}"] = row = _time_steps(size, attention, lengths, device, warmup, steps,
                                                                      flops["flops"])
            except Exception as exc:  # noqa: BLE001 - one attention failing (e.g. out of memory) keeps the others
                traceback.print_exc()
                numbers[f"attention={attention}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                failures.append(f"{attention}: {type(exc).__name__}")
                continue
            if device.type == "cuda" and not 0 < row["mfu"] < 1:
                failures.append(f"{attention}: MFU {row['mfu']} outside (0, 1): FLOPs formula or timing wrong")
            if not math.isfinite(row["loss"]):
                failures.append(f"{attention}: loss {row['loss']}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return verdict(failures, numbers, "train step timed (see tokens_per_s and mfu)")


# ------------------------------------------------------------------------------------------------- two ranks
def _read(path: str) -> str:
    """A rank's log ("" when the rank died before opening it)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


DUPLICATE_GPU_MARKERS = ("Duplicate GPU detected", "ncclInvalidUsage")


def _rank_main(rank: int, ctx: Context, port: int, size: str, lengths, old_per_seq, out_dir: str) -> None:
    """One of two spawned ranks: half the sequences, FSDP2 step, rank 0 saves loss and full gradients to
    ``out_dir/rank0.pt``; the rank's output goes to ``<log_dir>/fsdp_two_ranks.rank<r>.log``."""
    log_dir = ctx.log_dir
    log = os.open(os.path.join(log_dir, f"fsdp_two_ranks.rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.setdefault("NCCL_DEBUG", "WARN")  # NCCL prints why it refuses a layout
    try:
        strict_fp32()
        torch.set_num_threads(1)
        device = init_group(ctx, rank, 2, port)
        model = build_policy(size, packed_attention(ctx), device)
        shard(model)
        half = len(lengths) // 2
        indices = list(range(half)) if rank == 0 else list(range(half, len(lengths)))
        mb = make_batch(SIZES[size]["vocab_size"], lengths, indices=indices)
        old = torch.cat([old_per_seq[i] for i in indices]).to(device)
        n_tok = sum(r for _, r in lengths)
        loss, _ = loss_backward(model, mb, old, device, n_tok, world=2)
        total = torch.tensor([loss], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        g = grads(model)
        if rank == 0:
            torch.save({"loss": float(total.item()), "grads": {n: t.cpu() for n, t in g.items()}},
                       os.path.join(out_dir, "rank0.pt"))
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


def _spawn_two_ranks(ctx: Context, size: str, lengths, old_per_seq, wait_s: float):
    """Run :func:`_rank_main` in two spawned processes for at most ``wait_s`` (then kill them). Returns (exit codes,
    ranks that hung, {rank: log text}, rank 0's saved result or None)."""
    import tempfile

    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix="gpu_check_two_ranks_")
    try:
        spawn, port = mp.get_context("spawn"), _free_port()
        procs = [spawn.Process(target=_rank_main, args=(r, ctx, port, size, lengths, old_per_seq, out_dir))
                 for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + wait_s
        for p in procs:
            p.join(max(deadline - time.monotonic(), 1))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        logs = {r: _read(os.path.join(ctx.log_dir, f"fsdp_two_ranks.rank{r}.log")) for r in range(2)}
        result = os.path.join(out_dir, "rank0.pt")
        got = torch.load(result) if os.path.exists(result) else None
        return [p.exitcode for p in procs], hung, logs, got
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def section_fsdp_two_ranks(ctx: Context) -> Result:
    """Two processes, one FSDP2 group, half the batch each, vs one unsharded process on the whole batch. On one GPU
    NCCL refuses two ranks on the same device; that refusal is detected in the ranks' logs and reported as SKIP."""
    strict_fp32()
    size, lengths = ("tiny" if ctx.dry_run else "small"), _lengths(ctx)
    device = torch.device("cuda", 0) if ctx.device == "cuda" else torch.device("cpu")
    reference = build_policy(size, packed_attention(ctx), device)
    mb = make_batch(SIZES[size]["vocab_size"], lengths)
    old = old_logprobs(reference, mb, device)
    old_per_seq = [t.cpu() for t in old.split([r for _, r in lengths])]
    loss_ref, _ = loss_backward(reference, mb, old, device, int(mb.response_mask.sum()))
    g_ref = {n: t.cpu() for n, t in grads(reference).items()}
    codes, hung, logs, got = _spawn_two_ranks(ctx, size, lengths, old_per_seq, wait_s=45 if ctx.dry_run else 60)
    numbers = {"model": size, "backend": ctx.backend, "exit_codes": codes, "hung_ranks": hung}
    refusal = [ln.strip() for text in logs.values() for ln in text.splitlines()
               if any(mark in ln for mark in DUPLICATE_GPU_MARKERS)]
    if refusal:
        numbers["nccl_message"] = refusal[0][:300]
        return Result("SKIP", "NCCL refuses two ranks on one GPU (needs 2 GPUs): " + refusal[0][:160], numbers)
    if hung or any(c != 0 for c in codes) or got is None:
        tails = {r: "\n".join(t.splitlines()[-8:]) for r, t in logs.items()}
        return Result("FAIL", f"ranks failed (exit codes {codes}, hung {hung}): {tails}", numbers)
    errs = {"loss_rel": abs(got["loss"] - loss_ref) / max(abs(loss_ref), 1e-12),
            "grad": _grad_diff(got["grads"], g_ref)}
    numbers.update(loss_two_ranks=got["loss"], loss_one_process=loss_ref,
                   **{k: float(f"{v:.3g}") for k, v in errs.items()}, tolerances=PARITY_TOL)
    failures = [f"{k} {errs[k]:.3g} > {PARITY_TOL[k]:g}" for k in errs if not errs[k] <= PARITY_TOL[k]]
    return verdict(failures, numbers, "2-rank FSDP2 step equals the 1-process step")
