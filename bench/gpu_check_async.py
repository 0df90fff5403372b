"""Device-check section ``async_overlap``: what ``rollout.mode`` buys when generation and training share one GPU.

The driver's own schedules (``cluster.loop.overlap.make_schedule``, built as ``GRPOJob`` builds them: ``sync``,
``one_step_off`` = ``AsyncSchedule`` with k = 1, ``async`` with k = 2) order three calls of real GPU work:

* ``generate(step)``: HF ``model.generate`` of a random Llama-shaped model (``SIZES[size]`` of
  :mod:`bench.gpu_check_train`, tied embeddings; bf16 on CUDA), B prompts × G samples, exactly N new tokens (no EOS),
  temperature 0.8, on its own CUDA stream (in the producer thread when the schedule overlaps), synchronised before it
  returns. Behaviour logprobs are the log-softmax of ``generate``'s processed scores (logits / T, the distribution the
  tokens were drawn from). Rewards are a STAND-IN verifier (the fraction of response tokens in the lower half of the
  vocabulary: no task, only something that varies within a group), turned into advantages by
  ``grpo.advantages.compute_advantages`` ("grpo": (r − mean_group) / (std_group + ε), Shao et al. 2024).
* ``train(batch)``: the FSDP2 step of :mod:`bench.gpu_check_train` (``fully_shard`` per decoder layer then the root;
  on CUDA ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``; ``ResponseLogprobModel`` on one packed micro-batch of
  the generated sequences; ``grpo.losses.policy_loss`` token-mean, clip 0.2/0.28; ``clip_grad_norm_`` 1; AdamW),
  repeated ``updates`` times per batch (GRPO's μ policy updates per batch, Shao et al. 2024), on the default stream.
* ``sync(result)``: the trainer's full weights copied into the generator's (one device-to-device copy per tensor, the
  one-GPU counterpart of the weight broadcast); the generator's policy version becomes the trainer's.

``updates`` is calibrated first: one update is timed alone and ``updates`` = round(generate seconds / update seconds),
clamped to [1, 16], so train ≈ generate, where overlapping can gain the most (ideal speed-up
(g + t + s) / (max(g, t) + s) → 2). Then generate, train and sync are each timed alone (medians of 2), and each mode
runs 1 + ``steps`` steps, every step prefetching the next as in the middle of a long run; the first step (nothing
prefetched) is excluded from the mean, as ``bench/bench_async.py`` does with its stand-ins. Inside the steps each
generate and train call is timed too: their slowdown against "alone" is what sharing the GPU (and the GIL: HF
generate is launch-bound Python) costs.

Numbers: ``generate_s``, ``train_s``, ``sync_s`` alone; ``generate_plus_train_s``, ``max_generate_train_s``;
``ideal_overlap_ratio``; per mode ``step_s`` (mean), ``step_s_max``, ``generate_s_in_steps``, ``train_s_in_steps``,
``staleness``; ``overlap_ratio`` = sync step_s / one_step_off step_s and ``async_ratio`` = sync / async (k = 2).
PASS needs the schedules' contract on real work, not a speed-up: staleness 0 in sync, exactly 1 in one_step_off and
1..k in async after the first step; each step trains its own batch; finite losses; nothing dropped; the generator's
weights equal to the trainer's (cast to the generator's dtype) after the last sync. The ratios are reported.

``--dry-run``: the tiny model on CPU (gloo, one intra-op thread), 2 × 2 sequences of 4 + 4 tokens, 2 timed steps
per mode: about 3 s of work after about 10 s of imports (torch, transformers' attention registry) on 2 busy cores.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time

import torch
import torch.distributed as dist

from bench.gpu_check import Context, Result, verdict
from bench.gpu_check_train import (SIZES, TEMPERATURE, _free_port, build_policy, full, init_group, llama_config,
                                   loss_backward, packed_attention, shard)

#: (rollout.mode, max_staleness k) of the modes compared; one_step_off is k = 1 by construction.
MODES = (("sync", 0), ("one_step_off", 1), ("async", 2))
#: calibrated updates per batch are clamped to this range.
UPDATES_RANGE = (1, 16)
LR = 1e-6


def _plan(ctx: Context) -> dict:
    """Sizes of the run: model, prompts B, samples per prompt G, prompt tokens P, new tokens N, timed steps."""
    if ctx.dry_run:
        return dict(size="tiny", prompts=2, group=2, prompt_tokens=4, new_tokens=4, steps=2)
    # HF generate of the 24-layer model is launch-bound (≈ 20-25 ms per token, estimated, not measured here): 48 new
    # tokens ≈ 1-1.5 s a call; the whole section is then ≈ 50 s on the GPU (timeout 90 s)
    return dict(size="0.5b", prompts=16, group=8, prompt_tokens=64, new_tokens=48, steps=3)


class OverlapRig:
    """The generator (a plain HF model on its own stream), the FSDP2 trainer and the sync between them.

    Args:
        ctx: the check's context (dry run: float32, no mixed precision). plan: :func:`_plan`'s sizes. device: where
            both models live (the process group is already initialised: FSDP2 needs it).
    Attributes:
        trainer_version: policy version of the trainer (+1 per train call); engine_version: of the generator
            (set by sync). calls: per kind ("generate", "train", "sync") the wall seconds of each call, appended.
    """

    def __init__(self, ctx: Context, plan: dict, device: torch.device):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from transformers import AutoModelForCausalLM

        self.plan, self.device, self.cuda = plan, device, device.type == "cuda"
        compute = torch.bfloat16 if self.cuda else torch.float32
        self.attention = packed_attention(ctx, compute)
        self.policy = build_policy(plan["size"], self.attention, device)
        with torch.device(device):
            self.generator = AutoModelForCausalLM.from_config(llama_config(plan["size"]), attn_implementation="sdpa",
                                                              dtype=compute).eval()
        self.generator.generation_config.eos_token_id = None  # exactly N new tokens: no sequence ends early
        self.generator.generation_config.pad_token_id = 0
        shard(self.policy, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if self.cuda else None)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=LR, weight_decay=0.0)
        self.gen_stream = torch.cuda.Stream(device) if self.cuda else None
        self.updates = 1
        self.trainer_version = self.engine_version = 0
        self.calls: dict[str, list[float]] = {"generate": [], "train": [], "sync": []}
        self.sync(None)  # the generator starts from the trainer's weights (version 0)
        self.calls["sync"].clear()

    def _wait(self, stream) -> None:
        """Wait for ``stream``'s work (the current stream when None); a no-op on CPU."""
        if self.cuda:
            (stream or torch.cuda.current_stream(self.device)).synchronize()

    def generate(self, step: int) -> dict:
        """The batch of ``step``: B·G sequences of P random prompt tokens (seeded by ``step``) + N sampled tokens.
        Returns {"step", "version" (the generator's policy version), "prompts" [BG, P] int64, "responses" [BG, N]
        int64, "logprobs" [BG, N] float32 (behaviour, natural log), "rewards" [BG] float32 (stand-in),
        "advantages" [BG] float32, "group_ids" [BG] int64}, all on the CPU.

        Raises:
            RuntimeError: ``generate`` returned another number of new tokens than N."""
        p = self.plan
        t0 = time.perf_counter()
        version = self.engine_version
        gen = torch.Generator().manual_seed(1000 + step)
        prompts = torch.randint(0, SIZES[p["size"]]["vocab_size"], (p["prompts"], p["prompt_tokens"]), generator=gen)
        prompts = prompts.repeat_interleave(p["group"], dim=0)
        stream = torch.cuda.stream(self.gen_stream) if self.cuda else contextlib.nullcontext()
        with stream, torch.no_grad():
            ids = prompts.to(self.device)
            out = self.generator.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                          temperature=TEMPERATURE, top_k=0, top_p=1.0,
                                          max_new_tokens=p["new_tokens"], output_scores=True,
                                          return_dict_in_generate=True)
            responses = out.sequences[:, p["prompt_tokens"]:]
            if responses.shape[1] != p["new_tokens"]:
                raise RuntimeError(f"generate returned {responses.shape[1]} new tokens, expected {p['new_tokens']}")
            # out.scores: N tensors [BG, V], the processed logits (logits / T) each token was drawn from
            logprobs = torch.stack([s.float().log_softmax(-1).gather(-1, responses[:, i, None])[:, 0]
                                    for i, s in enumerate(out.scores)], dim=1)
            responses, logprobs = responses.cpu(), logprobs.cpu()
        self._wait(self.gen_stream)
        rewards, group_ids, advantages = self._advantages(responses)
        self.calls["generate"].append(time.perf_counter() - t0)
        return {"step": step, "version": version, "prompts": prompts, "responses": responses, "logprobs": logprobs,
                "advantages": advantages, "rewards": rewards, "group_ids": group_ids}

    def _advantages(self, responses: torch.Tensor):
        """STAND-IN rewards [BG] (fraction of response tokens below V/2), group ids [BG] and GRPO advantages [BG]."""
        from grpo.advantages import compute_advantages

        vocab = SIZES[self.plan["size"]]["vocab_size"]
        rewards = (responses < vocab // 2).float().mean(dim=1)
        group_ids = torch.arange(self.plan["prompts"]).repeat_interleave(self.plan["group"])
        return rewards, group_ids, compute_advantages(rewards, group_ids, "grpo")

    def update(self, mb, old_flat, num_tokens: int) -> float:
        """One policy update (forward + backward of the packed batch, clip, AdamW); returns the loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss, _ = loss_backward(self.policy, mb, old_flat, self.device, num_tokens)
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.optimizer.step()
        return loss

    def pack(self, batch: dict):
        """(packed micro-batch, behaviour logprobs [M] in packed order, response tokens counted in the loss)."""
        from train_workers.packing import pack_microbatch

        n = batch["responses"].shape[0]
        mb = pack_microbatch(batch["prompts"].tolist(), batch["responses"].tolist(), batch["advantages"],
                             list(batch["logprobs"]), list(range(n)), group_ids=batch["group_ids"].tolist())
        old_flat = mb.behaviour_logprobs[mb.token_seq, mb.token_pos].to(self.device)
        return mb, old_flat, int(mb.response_mask.sum())

    def train(self, batch: dict) -> dict:
        """``updates`` policy updates on ``batch``; returns {"step", "staleness" (trainer version − the batch's),
        "losses"}; the trainer's version rises by one."""
        t0 = time.perf_counter()
        staleness = self.trainer_version - batch["version"]
        mb, old_flat, num_tokens = self.pack(batch)
        losses = [self.update(mb, old_flat, num_tokens) for _ in range(self.updates)]
        self._wait(None)
        self.trainer_version += 1
        self.calls["train"].append(time.perf_counter() - t0)
        return {"step": batch["step"], "staleness": staleness, "losses": losses}

    def sync(self, trained: dict | None) -> dict | None:
        """Copy the trainer's full weights into the generator; its version becomes the trainer's.

        Raises:
            RuntimeError: the two models' parameter names differ (the trainer's carry the ``model.`` prefix of
                ``ResponseLogprobModel``)."""
        t0 = time.perf_counter()
        target = dict(self.generator.named_parameters())
        source = {n.removeprefix("model."): p for n, p in self.policy.named_parameters()}
        if source.keys() != target.keys():
            raise RuntimeError(f"trainer/generator parameters differ: {sorted(source.keys() ^ target.keys())[:6]}")
        with torch.no_grad():
            for name, param in source.items():
                target[name].copy_(full(param))
        self._wait(None)
        self.engine_version = self.trainer_version
        self.calls["sync"].append(time.perf_counter() - t0)
        return trained

    def weight_gap(self) -> float:
        """max |generator − trainer (cast to the generator's dtype)| over all parameters (0 right after a sync)."""
        target = dict(self.generator.named_parameters())
        with torch.no_grad():
            return max((target[n.removeprefix("model.")].float()
                        - full(p).to(target[n.removeprefix("model.")].dtype).float()).abs().max().item()
                       for n, p in self.policy.named_parameters())


def _median_time(fn, repeats: int = 2) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(rig: OverlapRig) -> dict:
    """Warm up, choose ``rig.updates`` so train ≈ generate, then time generate, train and sync alone (medians).
    Returns the alone numbers (seconds)."""
    batch = rig.generate(0)  # warm-up: kernels, allocator, cuBLAS handles
    mb, old_flat, num_tokens = rig.pack(batch)
    rig.update(mb, old_flat, num_tokens)
    rig.sync(None)
    generate_s = _median_time(lambda: rig.generate(0))

    def one_update():
        rig.update(mb, old_flat, num_tokens)
        rig._wait(None)

    update_s = _median_time(one_update, 3)
    lo, hi = UPDATES_RANGE
    rig.updates = max(lo, min(hi, round(generate_s / max(update_s, 1e-9))))
    train_s = _median_time(lambda: rig.train(batch))
    sync_s = _median_time(lambda: rig.sync(None))
    for calls in rig.calls.values():
        calls.clear()
    return {"generate_s": generate_s, "update_s": update_s, "train_s": train_s, "sync_s": sync_s}


def run_mode(rig: OverlapRig, mode: str, k: int, steps: int) -> dict:
    """1 + ``steps`` steps of ``mode`` through ``make_schedule`` (every step prefetching the next); the first step is
    not timed. Returns the mode's numbers and, under "_outcomes", the step outcomes."""
    from cluster.loop.overlap import make_schedule

    dropped: list = []
    schedule = make_schedule(mode, rig.generate, rig.train, rig.sync, max_staleness=max(k, 1),
                             version=lambda: rig.trainer_version, batch_version=lambda batch: batch["version"],
                             drop=dropped.append)
    seconds, outcomes, marks = [], [], {}
    for step in range(1, steps + 2):
        if step == 2:
            marks = {kind: len(calls) for kind, calls in rig.calls.items()}
        t0 = time.perf_counter()
        outcomes.append(schedule.step(step, prefetch_next=True))
        seconds.append(time.perf_counter() - t0)
    in_steps = {kind: calls[marks[kind]:] for kind, calls in rig.calls.items()}
    schedule.discard()  # batches generated ahead of a step that is not run
    rig.sync(None)  # the next mode starts on-policy
    for calls in rig.calls.values():
        calls.clear()
    timed = seconds[1:]
    return {"step_s": statistics.mean(timed), "step_s_max": max(timed),
            "generate_s_in_steps": statistics.mean(in_steps["generate"]) if in_steps["generate"] else None,
            "generate_calls_in_steps": len(in_steps["generate"]),
            "train_s_in_steps": statistics.mean(in_steps["train"]),
            "staleness": [o.trained["staleness"] for o in outcomes], "dropped": len(dropped),
            "_outcomes": outcomes}


def _contract(mode: str, k: int, row: dict, steps: int) -> list[str]:
    """The schedule's contract on this mode's steps: failures, human-readable."""
    failures = []
    outcomes = row.pop("_outcomes")
    expected_steps = list(range(1, steps + 2))
    if [o.trained["step"] for o in outcomes] != expected_steps:
        failures.append(f"{mode}: trained batches of steps {[o.trained['step'] for o in outcomes]}, expected "
                        f"{expected_steps}")
    staleness = row["staleness"]
    if mode == "sync":
        ok = all(s == 0 for s in staleness)
    elif mode == "one_step_off":
        ok = staleness == [0] + [1] * steps
    else:
        ok = staleness[0] == 0 and all(1 <= s <= k for s in staleness[1:])
    if not ok:
        failures.append(f"{mode}: staleness {staleness}")
    losses = [loss for o in outcomes for loss in o.trained["losses"]]
    if not all(math.isfinite(loss) for loss in losses):
        failures.append(f"{mode}: non-finite loss in {losses}")
    if row["dropped"]:
        failures.append(f"{mode}: {row['dropped']} stale drop(s)")
    return failures


def section_async_overlap(ctx: Context) -> Result:
    """sync vs one_step_off vs async (k = 2) step seconds with real generate and train sharing one GPU (module doc)."""
    plan = _plan(ctx)
    if ctx.dry_run:
        # one intra-op thread per Python thread: with OpenMP's default (one per core) the producer's and the
        # trainer's thread teams oversubscribe two shared cores, and a sync step (both in one thread) measured
        # 1-4 s instead of 0.06 s on the tiny model
        torch.set_num_threads(1)
    device = init_group(ctx, 0, 1, _free_port())
    try:
        rig = OverlapRig(ctx, plan, device)
        alone = calibrate(rig)
        rows, failures = {}, []
        for mode, k in MODES:
            rows[mode] = run_mode(rig, mode, k, plan["steps"])
            failures += _contract(mode, k, rows[mode], plan["steps"])
        gap = rig.weight_gap()
    finally:
        dist.destroy_process_group()
    g, t, s = alone["generate_s"], alone["train_s"], alone["sync_s"]
    tokens = plan["prompts"] * plan["group"] * plan["new_tokens"]
    numbers = {"model": plan["size"], "device": str(device), "train_attention": rig.attention,
               "batch": (f"{plan['prompts']} prompts × {plan['group']} samples, {plan['prompt_tokens']} prompt + "
                         f"{plan['new_tokens']} new tokens"),
               "updates_per_step": rig.updates, "update_s": round(alone["update_s"], 4),
               "generate_s": round(g, 4), "generate_tokens_per_s": round(tokens / g),
               "train_s": round(t, 4), "sync_s": round(s, 4),
               "generate_plus_train_s": round(g + t, 4), "max_generate_train_s": round(max(g, t), 4),
               "ideal_overlap_ratio": round((g + t + s) / (max(g, t) + s), 3), "timed_steps": plan["steps"],
               **{f"mode={m}": {key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}
                  for m, row in rows.items()},
               "overlap_ratio": round(rows["sync"]["step_s"] / rows["one_step_off"]["step_s"], 3),
               "async_ratio": round(rows["sync"]["step_s"] / rows["async"]["step_s"], 3),
               "weight_gap_after_sync": gap}
    if device.type == "cuda":
        numbers["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if gap != 0.0:
        failures.append(f"generator weights differ from the trainer's after the sync by {gap:.3g}")
    summary = (f"sync {rows['sync']['step_s']:.3f} s/step, one_step_off {rows['one_step_off']['step_s']:.3f} "
               f"(×{numbers['overlap_ratio']}), async k=2 {rows['async']['step_s']:.3f} (×{numbers['async_ratio']}); "
               f"max(g, t) {max(g, t):.3f}, g + t {g + t:.3f}")
    return verdict(failures, numbers, summary)
