"""Device-check sections for the two kernels of the train step: the fused LM head and packed varlen attention.

Both compare the project's code on the check's device against references computed here in float64, from the same
(already rounded) inputs, so only the kernel's own arithmetic is measured. Errors are relative Frobenius norms
``‖x − ref‖ / ‖ref‖`` unless named ``max_abs``. TF32 is switched off: float32 means float32.

Sizes on the GPU are those of the 0.5B model of the throughput section (H = 896, V = 151,936, 14 query heads and
2 key/value heads of 64); ``--dry-run`` uses tiny ones.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from bench.gpu_check import Context, Result, verdict

#: (relative-error tolerance for values, for gradients) per input dtype.
LM_HEAD_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 3e-2)}
#: max |logprob − reference| (nats) per input dtype: bf16 logits are rounded to 8 bits before the float32 softmax.
LM_HEAD_MAX_ABS = {torch.float32: 1e-4, torch.bfloat16: 0.1}
ATTN_TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (2e-2, 5e-2)}
#: max |hidden − reference| of the last hidden state, float32 model, packed row vs each sequence alone.
MODEL_MAX_ABS = 1e-4


def strict_fp32() -> None:
    """No TF32 in matmuls or convolutions (the references assume IEEE float32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (0 when both are 0)."""
    x, ref = x.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    return (x - ref).norm().item() / denom if denom > 0 else (x - ref).norm().item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ fused LM head
def _reference_head(hidden, weight, targets, upstream, temperature):
    """float64 logprobs [M], entropies [M] and gradients of Σ upstream·logprobs w.r.t. hidden [M, H], weight [V, H]."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logp = torch.log_softmax(F.linear(h, w) / temperature, dim=-1)
    lp = logp.gather(-1, targets[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    (lp * upstream).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def section_fused_lm_head(ctx: Context) -> Result:
    """``linear_logprobs`` (one chunk and several) in float32 and bfloat16 vs the float64 reference: logprobs,
    entropies, and the gradients w.r.t. hidden states and head weight; on CUDA also its peak memory and time against
    the unfused ``linear`` + ``logprobs_from_logits``."""
    from grpo.logprobs import entropy_from_logits, linear_logprobs, logprobs_from_logits

    strict_fp32()
    device = torch.device(ctx.device)
    m, h, v, chunk = (48, 32, 1000, 20) if ctx.dry_run else (2048, 896, 151_936, 512)
    temperature = 0.7
    gen = torch.Generator(device=device).manual_seed(0)
    hidden64 = torch.randn(m, h, generator=gen, device=device, dtype=torch.float64)
    weight64 = torch.randn(v, h, generator=gen, device=device, dtype=torch.float64) * 0.05
    targets = torch.randint(0, v, (m,), generator=gen, device=device)
    upstream = torch.randn(m, generator=gen, device=device, dtype=torch.float64)
    numbers: dict = {"M": m, "H": h, "V": v, "chunk_size": chunk, "temperature": temperature}
    failures: list[str] = []
    for dtype in (torch.float32, torch.bfloat16):
        hid_d, w_d = hidden64.to(dtype), weight64.to(dtype)
        ref_lp, ref_ent, ref_gh, ref_gw = _reference_head(hid_d, w_d, targets, upstream, temperature)
        tol, tol_grad = LM_HEAD_TOL[dtype]
        for chunk_size in (None, chunk):
            hid, w = hid_d.clone().requires_grad_(), w_d.clone().requires_grad_()
            lp, ent = linear_logprobs(hid, w, targets, temperature, chunk_size=chunk_size, with_entropy=True)
            (lp.double() * upstream).sum().backward()
            key = f"{str(dtype).removeprefix('torch.')}_chunk{chunk_size or m}"
            errs = {"logprob_max_abs": (lp.double() - ref_lp).abs().max().item(), "logprob_rel": rel_err(lp, ref_lp),
                    "entropy_rel": rel_err(ent, ref_ent), "grad_hidden_rel": rel_err(hid.grad, ref_gh),
                    "grad_weight_rel": rel_err(w.grad, ref_gw)}
            numbers[key] = {k: float(f"{x:.3g}") for k, x in errs.items()}
            limits = {"logprob_max_abs": LM_HEAD_MAX_ABS[dtype], "logprob_rel": tol, "entropy_rel": tol,
                      "grad_hidden_rel": tol_grad, "grad_weight_rel": tol_grad}
            failures += [f"{key} {k} {errs[k]:.3g} > {lim:g}" for k, lim in limits.items()
                         if not errs[k] <= lim]
    numbers["tolerances"] = {str(d).removeprefix("torch."): {"rel": t, "grad_rel": g, "logprob_max_abs":
                                                             LM_HEAD_MAX_ABS[d]} for d, (t, g) in LM_HEAD_TOL.items()}
    if device.type == "cuda":
        numbers["memory_time_bf16"] = _head_memory_time(device, hidden64, weight64, targets, temperature, chunk,
                                                        linear_logprobs, logprobs_from_logits, entropy_from_logits)
        mem = numbers["memory_time_bf16"]
        if not mem["fused_peak_mib"] < mem["unfused_peak_mib"]:
            failures.append(f"fused peak {mem['fused_peak_mib']} MiB not below unfused {mem['unfused_peak_mib']} MiB")
    return verdict(failures, numbers, "fused LM head matches the float64 reference (values and gradients)")


def _head_memory_time(device, hidden64, weight64, targets, temperature, chunk, linear_logprobs, logprobs_from_logits,
                      entropy_from_logits) -> dict:
    """Peak extra CUDA memory (MiB) and time (ms) of forward + backward, fused (chunked) vs unfused, bf16 inputs."""
    def fused(hid, w):
        lp, _ = linear_logprobs(hid, w, targets, temperature, chunk_size=chunk, with_entropy=True)
        return lp

    def unfused(hid, w):
        logits = F.linear(hid, w)
        with torch.no_grad():
            entropy_from_logits(logits, temperature, chunk_size=chunk)
        return logprobs_from_logits(logits, targets, temperature)

    out = {}
    for name, fn in (("fused", fused), ("unfused", unfused)):
        times = []
        for _ in range(3):
            hid = hidden64.to(torch.bfloat16).requires_grad_()
            w = weight64.to(torch.bfloat16).requires_grad_()
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            fn(hid, w).sum().backward()
            _sync(device)
            times.append(time.perf_counter() - t0)
            out[f"{name}_peak_mib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)
            del hid, w
        out[f"{name}_ms"] = round(min(times[1:]) * 1e3, 2)
    return out


# ----------------------------------------------------------------------------------------------- varlen attention
def _reference_attention(q, k, v, lengths, scale):
    """float64 causal attention within each sequence of a packed row. q [1, H, L, D], k/v [1, H_kv, L, D] →
    [1, L, H, D] (the layout transformers' attention functions return)."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs = q[0, :, start:start + n]
        ks = k[0, :, start:start + n].repeat_interleave(groups, 0)
        vs = v[0, :, start:start + n].repeat_interleave(groups, 0)
        scores = qs @ ks.transpose(-1, -2) * scale
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        outs.append((scores.masked_fill(~causal, -math.inf).softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)[None]


def _positions(lengths, device) -> torch.Tensor:
    return torch.cat([torch.arange(n, device=device) for n in lengths])[None]


def _function_level(device, dry_run: bool) -> tuple[dict, list[str]]:
    """``varlen_sdpa_attention`` in float32 and bfloat16 (values and q/k/v gradients) vs float64 per sequence."""
    from train_workers.packing import varlen_sdpa_attention

    lengths = [5, 1, 9, 3] if dry_run else [37, 1, 128, 300, 64, 1024]
    heads, kv_heads, dim = (4, 2, 16) if dry_run else (14, 2, 64)
    total = sum(lengths)
    gen = torch.Generator(device=device).manual_seed(1)
    q64 = torch.randn(1, heads, total, dim, generator=gen, device=device, dtype=torch.float64)
    k64 = torch.randn(1, kv_heads, total, dim, generator=gen, device=device, dtype=torch.float64)
    v64 = torch.randn(1, kv_heads, total, dim, generator=gen, device=device, dtype=torch.float64)
    upstream = torch.randn(1, total, heads, dim, generator=gen, device=device, dtype=torch.float64)
    scale = dim ** -0.5
    numbers, failures = {"lengths": lengths, "heads": heads, "kv_heads": kv_heads, "head_dim": dim}, []
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [t.to(dtype).requires_grad_() for t in (q64, k64, v64)]
        refs = [t.detach().double().requires_grad_() for t in leaves]
        ref = _reference_attention(*refs, lengths, scale)
        (ref * upstream).sum().backward()
        out, _ = varlen_sdpa_attention(None, *leaves, None, scaling=scale, position_ids=_positions(lengths, device))
        (out.double() * upstream).sum().backward()
        errs = {"out_rel": rel_err(out, ref), **{f"grad_{n}_rel": rel_err(a.grad, r.grad)
                                                 for n, a, r in zip("qkv", leaves, refs)}}
        key = str(dtype).removeprefix("torch.")
        numbers[key] = {k: float(f"{x:.3g}") for k, x in errs.items()}
        tol, tol_grad = ATTN_TOL[dtype]
        failures += [f"varlen_sdpa {key} {k} {x:.3g} > {tol if k == 'out_rel' else tol_grad:g}"
                     for k, x in errs.items() if not x <= (tol if k == "out_rel" else tol_grad)]
    return numbers, failures


def _model_level(device, dry_run: bool) -> tuple[dict, list[str]]:
    """A float32 Llama's last hidden state for a packed row, per attention implementation, vs each sequence run
    alone with eager attention (no packing). Covers transformers' mask-from-position-ids path (``sdpa``, what
    ``FSDPTrainWorker`` uses on CUDA without flash-attn) and the project's ``packed_varlen_sdpa``; flash-attn's
    varlen kernel too when installed (bf16: it has no float32 kernel)."""
    import importlib.util

    from transformers import AutoModelForCausalLM, LlamaConfig

    from train_workers.packing import register_varlen_sdpa

    varlen = register_varlen_sdpa()
    lengths = [5, 1, 9, 3] if dry_run else [37, 1, 128, 300, 64]
    cfg = LlamaConfig(hidden_size=64 if dry_run else 256, intermediate_size=128 if dry_run else 688,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16 if dry_run else 64,
                      vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    models = {}
    for impl in ("eager", "sdpa", varlen):
        models[impl] = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32)
        if impl != "eager":
            models[impl].load_state_dict(models["eager"].state_dict())
        models[impl].to(device).eval()
    gen = torch.Generator(device=device).manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), generator=gen, device=device)
    pos = _positions(lengths, device)
    numbers, failures = {"lengths": lengths, "hidden_size": cfg.hidden_size, "tolerance_max_abs": MODEL_MAX_ABS}, []
    with torch.no_grad():
        eager = models["eager"].get_decoder()
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        ref = torch.cat([eager(input_ids=ids[:, a:b], use_cache=False).last_hidden_state
                         for a, b in zip(starts[:-1], starts[1:])], dim=1)
        for impl in ("sdpa", varlen):
            out = models[impl].get_decoder()(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            err = (out - ref).abs().max().item()
            numbers[f"{impl}_fp32_max_abs"] = float(f"{err:.3g}")
            if not err <= MODEL_MAX_ABS:
                failures.append(f"packed {impl} float32 differs from per-sequence eager by {err:.3g}")
        if device.type == "cuda" and importlib.util.find_spec("flash_attn"):
            flash = AutoModelForCausalLM.from_config(cfg, attn_implementation="flash_attention_2",
                                                     dtype=torch.bfloat16)
            flash.load_state_dict(models["eager"].state_dict())
            out = flash.to(device).get_decoder()(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            err = rel_err(out, ref)
            numbers["flash_attention_2_bf16_rel"] = float(f"{err:.3g}")
            if not err <= 5e-2:
                failures.append(f"packed flash_attention_2 bf16 rel error {err:.3g} > 0.05")
        else:
            numbers["flash_attention_2"] = "not checked: flash_attn not installed" if device.type == "cuda" \
                else "not checked: CUDA only"
    return numbers, failures


def section_varlen_attention(ctx: Context) -> Result:
    """Packed varlen attention: the function against float64, and whole packed rows against unpacked sequences."""
    strict_fp32()
    device = torch.device(ctx.device)
    fn_numbers, fn_failures = _function_level(device, ctx.dry_run)
    model_numbers, model_failures = _model_level(device, ctx.dry_run)
    numbers = {"function": fn_numbers, "model": model_numbers,
               "tolerances": {str(d).removeprefix("torch."): {"out_rel": t, "grad_rel": g}
                              for d, (t, g) in ATTN_TOL.items()}}
    return verdict(fn_failures + model_failures, numbers, "packed attention matches the per-sequence references")
