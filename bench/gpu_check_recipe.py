"""Device-check section ``recipe_1gpu``: the trainer side of the one-GPU recipe
(``examples/gpu_1x_qwen0.5b_gsm8k.yaml``) for a few steps, on the lent GPU, with torch and transformers only (no
vLLM, Ray or pydantic there).

What runs, read from the recipe's YAML (PyYAML; the spec classes need pydantic, which the device image lacks): a
random-weight model of the recipe's shape (Qwen2.5-0.5B's dimensions in a Llama, ``bench.gpu_check_train.SIZES
["0.5b"]``; the hub is unreachable from the device) in ``train_workers.policy.ResponseLogprobModel``, sharded by the
project's ``train_workers.sharding.shard_model`` with the recipe's ``model.dtype`` mixed precision and
``train.cpu_offload``, transformers' gradient checkpointing when ``train.activation_checkpointing``, AdamW at the
learning rate ``cluster.loop.lr_schedule.LRSchedule`` gives each step from the recipe's schedule, and one step's batch
of the recipe's size (``rollout.prompts_per_step`` × ``group_size`` sequences of a 150-token prompt and a response of
up to ``max_response_tokens``), packed into micro-batches of at most ``train.max_tokens_per_microbatch`` tokens.
Then one more step with activation checkpointing off, for its peak memory.

PASS when every step's loss and gradient norm are finite, each step trained at the schedule's rate, and (on CUDA)
activation checkpointing lowered the step's peak memory. Numbers: seconds and tokens/s per step, peak GPU memory with
and without activation checkpointing. ``--dry-run``: a tiny model and batch on CPU (gloo), memory not compared.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import yaml

from bench.gpu_check import REPO, Context, Result, verdict
from bench.gpu_check_train import SIZES, _free_port, build_policy, full, init_group, loss_backward, old_logprobs, \
    packed_attention

RECIPE = REPO / "examples" / "gpu_1x_qwen0.5b_gsm8k.yaml"
TRAIN_DEFAULTS = {"lr_schedule": "constant", "warmup_steps": 0, "warmup_ratio": None, "min_lr_ratio": 0.0,
                  "activation_checkpointing": False, "cpu_offload": False, "max_tokens_per_microbatch": 4096,
                  "reduce_dtype": "float32", "max_grad_norm": 1.0}


def read_recipe(path: Path = RECIPE) -> dict:
    """The recipe's sections as plain dicts (train with :data:`TRAIN_DEFAULTS` filled in)."""
    raw = yaml.safe_load(path.read_text())
    raw["train"] = {**TRAIN_DEFAULTS, **raw.get("train", {})}
    return raw


def recipe_batch(recipe: dict, vocab: int, dry_run: bool, seed: int = 0) -> list:
    """One step's sequences packed into micro-batches (greedy, in order) under the token budget."""
    from train_workers.packing import pack_microbatch

    rollout, budget = recipe["rollout"], recipe["train"]["max_tokens_per_microbatch"]
    n = 8 if dry_run else rollout["prompts_per_step"] * rollout["group_size"]
    cap = 16 if dry_run else rollout["max_response_tokens"]
    prompt = 12 if dry_run else 150
    budget = 128 if dry_run else budget
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    lengths = [(prompt, rng.randint(max(1, cap // 8), cap)) for _ in range(n)]
    groups, current, used = [], [], 0
    for i, (p, r) in enumerate(lengths):
        if current and used + p + r > budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += p + r
    groups.append(current)
    prompts = [torch.randint(3, vocab, (p,), generator=gen).tolist() for p, _ in lengths]
    responses = [torch.randint(3, vocab, (r,), generator=gen).tolist() for _, r in lengths]
    advantages = [1.0 if i % 2 else -1.0 for i in range(n)]
    return [pack_microbatch([prompts[i] for i in g], [responses[i] for i in g], [advantages[i] for i in g],
                            [torch.zeros(lengths[i][1]) for i in g], g) for g in groups]


def _train_step(model, optimizer, mbs, device, lr: float) -> dict:
    """One GRPO step over ``mbs`` at learning rate ``lr``; returns its figures."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    n_tok = sum(int(mb.response_mask.sum()) for mb in mbs)
    olds = [old_logprobs(model, mb, device) for mb in mbs]
    loss = sum(loss_backward(model, mb, old, device, n_tok)[0] for mb, old in zip(mbs, olds))
    norm = float(full(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(mb.num_tokens for mb in mbs)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"loss": loss, "grad_norm": norm, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "lr": optimizer.param_groups[0]["lr"], "peak_gib": peak, "tokens": tokens, "microbatches": len(mbs)}


def section_recipe_1gpu(ctx: Context) -> Result:
    """The one-GPU recipe's trainer side for a few steps (module docstring)."""
    from cluster.loop.lr_schedule import LRSchedule
    from train_workers.sharding import decoder_layers, mixed_precision_policy, shard_model

    recipe = read_recipe()
    train, dtype = recipe["train"], recipe["model"].get("dtype", "float32")
    schedule = LRSchedule.from_spec(SimpleNamespace(**train), recipe["total_steps"])
    device = init_group(ctx, 0, 1, _free_port())
    size = "tiny" if ctx.dry_run else "0.5b"
    compute = torch.bfloat16 if dtype == "bfloat16" and not ctx.dry_run else torch.float32
    steps = []
    try:
        model = build_policy(size, packed_attention(ctx, compute), device)
        if train["activation_checkpointing"]:
            model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        shard_model(model, mp_policy=mixed_precision_policy(compute, train["reduce_dtype"]),
                    cpu_offload=train["cpu_offload"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=train["lr"], weight_decay=0.0)
        mbs = recipe_batch(recipe, SIZES[size]["vocab_size"], ctx.dry_run)
        for step in range(1, (2 if ctx.dry_run else 3) + 1):
            steps.append({"step": step, "schedule_lr": schedule.lr(step),
                          **_train_step(model, optimizer, mbs, device, schedule.lr(step))})
        for layer in decoder_layers(model):
            layer.gradient_checkpointing = False
        without_ac = _train_step(model, optimizer, mbs, device, schedule.lr(len(steps) + 1))
    finally:
        dist.destroy_process_group()
    failures = [f"step {s['step']}: non-finite loss {s['loss']} or grad norm {s['grad_norm']}" for s in steps
                if not (math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]))]
    failures += [f"step {s['step']} trained at lr {s['lr']:.3g}, the schedule says {s['schedule_lr']:.3g}"
                 for s in steps if s["lr"] != s["schedule_lr"]]
    last = steps[-1]
    if device.type == "cuda" and train["activation_checkpointing"] and not last["peak_gib"] < without_ac["peak_gib"]:
        failures.append(f"activation checkpointing did not lower the peak memory: {last['peak_gib']:.2f} GiB vs "
                        f"{without_ac['peak_gib']:.2f} GiB without")
    numbers = {"recipe": str(RECIPE.relative_to(REPO)), "model": size, "compute_dtype": str(compute),
               "activation_checkpointing": train["activation_checkpointing"], "cpu_offload": train["cpu_offload"],
               "sequences": sum(mb.num_sequences for mb in mbs), "steps": steps,
               "without_activation_checkpointing": without_ac}
    ok = (f"{len(steps)} steps at the schedule's rates, {last['tokens_per_s']:.0f} tok/s"
          + (f", peak {last['peak_gib']:.1f} GiB vs {without_ac['peak_gib']:.1f} GiB without activation checkpointing"
             if last["peak_gib"] is not None else ""))
    return verdict(failures, numbers, ok)
