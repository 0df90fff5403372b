"""Train throughput: GRPO train steps of the FSDP2 (:class:`train_workers.fsdp_worker.FSDPTrainWorker`) or, with
``--strategy megatron``, the Megatron-core backend (:class:`train_workers.megatron.worker.MegatronTrainWorker`, TP
``--tensor-parallel-size``, DP = world size / TP) on CPU, on the same synthetic batch.

What is measured: ``--world-size`` ranks (default 2) spawned with ``torch.multiprocessing`` (start method spawn), each
with ``torch.set_num_threads(1)``, join a gloo process group and build the FSDP2-sharded policy, the frozen reference
policy (``kl_coef`` > 0, default 0.04) and AdamW exactly as the driver's train pool does (``init_distributed``).
The batch is synthetic but shaped like a GRPO step: N sequences (default 16) of a prompt of ``--prompt-len`` ± 10
random tokens plus a response of uniform(``--resp-min``, ``--resp-max``) random tokens (default 32..128), random
normal advantages and behaviour logprobs. It is balanced over ranks and packed into micro-batches with the driver's
code path (``cluster.loop.scheduler.plan_microbatches`` + ``train_workers.packing.pack_microbatch``, budget
``--max-tokens-per-microbatch``). Every step trains on the same batch.

Timed: one ``train_step`` (reference forward, policy forward + backward, grad clip, metric all-reduce, AdamW step),
bracketed by ``dist.barrier()`` on every rank, so a step is as slow as its slowest rank. One warm-up step, then
``--steps`` timed steps; the median is reported.

With ``--lora-rank R`` the policy is the same model with LoRA adapters (``train.lora``: rank R, all linear layers;
the reference pass is the policy with its adapters off, no reference copy is built).

With ``--activation-checkpointing`` (``train.activation_checkpointing``) the policy's decoder layers recompute their
activations in the backward; with ``--cpu-offload`` (``train.cpu_offload``) FSDP2 keeps the policy's shards, gradients
and AdamW state on the CPU (on CPU ranks nothing moves: it measures the policy's own overhead). Compare the memory
measures below and seconds per step against a run without the flag on the same batch (docs/results.md).

Memory, per rank, in GiB (``bench._memory.StepPeakMeter``): *runtime RSS* before the models are built (the Python and
torch runtime); *resting RSS* just before the first timed step (models, reference, AdamW state after the warm-up step,
free heap handed back to the OS); *step peak RSS* the largest peak RSS (``VmHWM``, reset before each step) of a timed
step; *step above rest* the largest (step peak − that step's resting RSS): the step's own activations and temporaries,
what activation checkpointing addresses; *process peak RSS* the whole process's peak since it started (model loading
included). The per-step reset also resets the kernel counter behind ``ru_maxrss``, so the step metrics'
``memory/train_peak_rss_gib`` here is the peak since the step began.

With ``--strategy megatron`` on a machine without CUDA, each rank first installs the CPU shims of
``tests/megatron_cpu.py`` (megatron-core 0.16.1 assumes CUDA in three places; the backend itself carries no shim).

Reported: packed tokens per step (all ranks; prompt + response tokens the forward passes compute), seconds per step,
tokens/s, each rank's memory (above) and AdamW state bytes, trainable parameters, and achieved
GFLOP/s = (6·N_params·T [policy fwd+bwd] + 2·N_params·T [reference fwd]) / seconds, with
N_params the policy's parameter count (tied embedding counted once) and T the packed tokens. That convention
over-counts the LM head (applied only at response positions) and the embedding lookup, and ignores attention's
O(L²) term, so it is a comparable "model FLOPs" number, not a hardware counter (with LoRA the backward skips the
frozen weights' gradients, so the same count over-states the work).

Usage (from the repo root)::

    .venv/bin/python -m bench.bench_train                       # 2 ranks, N=16, 1 warm-up + 3 timed steps
    .venv/bin/python -m bench.bench_train --quick               # tiny batch, 1 timed step: a correctness smoke run
    .venv/bin/python -m bench.bench_train --world-size 1 --kl-coef 0
    .venv/bin/python -m bench.bench_train --lora-rank 16              # the same batch with a LoRA policy
    .venv/bin/python -m bench.bench_train --max-tokens-per-microbatch 1024 --activation-checkpointing  # vs without
    .venv/bin/python -m bench.bench_train --strategy megatron --tensor-parallel-size 2   # the same batch, Megatron TP=2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from bench._common import DEFAULT_MODEL, load_note, print_json, print_table, resolve_model
from bench._memory import StepPeakMeter
from train_workers.registry import TRAIN_BACKENDS  # names only: no backend is imported


def synthetic_batch(n: int, prompt_len: int, resp_min: int, resp_max: int, vocab: int, seed: int) -> dict:
    """N (prompt, response) pairs of random token ids (avoiding ids 0..2: unk/bos/eos), advantages, logprobs."""
    import torch

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    prompts, responses, behaviour = [], [], []
    for _ in range(n):
        p = max(1, prompt_len + rng.randint(-10, 10))
        r = rng.randint(resp_min, resp_max)
        prompts.append(torch.randint(3, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(3, vocab, (r,), generator=g).tolist())
        behaviour.append(-torch.rand(r, generator=g) * 5)
    advantages = torch.randn(n, generator=g)
    return {"prompt_ids": prompts, "response_ids": responses, "behaviour_logprobs": behaviour,
            "advantages": advantages}


def rank_microbatches(batch: dict, world_size: int, budget: int):
    """The driver's balancing + packing (``cluster.loop.training.microbatches``): per-rank lists of packed
    micro-batches."""
    from cluster.loop.scheduler import plan_microbatches
    from train_workers.packing import pack_rank_microbatches

    lengths = [len(p) + len(r) for p, r in zip(batch["prompt_ids"], batch["response_ids"])]
    plan = plan_microbatches(lengths, world_size, budget)
    per_rank = pack_rank_microbatches(plan.ranks, batch["prompt_ids"], batch["response_ids"], batch["advantages"],
                                      batch["behaviour_logprobs"])
    return per_rank, plan.stats(lengths)


def _rank_main(rank: int, args: argparse.Namespace, model_path: str, port: int, queue) -> None:
    """One train rank: init, warm-up, timed steps; rank 0 reports to ``queue``."""
    import torch

    torch.set_num_threads(args.threads)
    import torch.distributed as dist
    from transformers import AutoConfig

    from cluster.spec import AlgorithmSpec, LoraSpec, TrainSpec
    from train_workers.registry import train_backend

    if args.strategy == "megatron" and not torch.cuda.is_available():
        from tests.megatron_cpu import install_cpu_shims

        install_cpu_shims()
    lora = LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha) if args.lora_rank else None
    train = TrainSpec(world_size=args.world_size, num_threads=args.threads, backend="gloo",
                      max_tokens_per_microbatch=args.max_tokens_per_microbatch, lora=lora, strategy=args.strategy,
                      tensor_parallel_size=args.tensor_parallel_size,
                      activation_checkpointing=args.activation_checkpointing, cpu_offload=args.cpu_offload)
    algorithm = AlgorithmSpec(kl_coef=args.kl_coef)
    worker = train_backend(args.strategy)(rank, args.world_size, model_path, train, algorithm, temperature=1.0,
                                          max_response_tokens=args.resp_max, dtype="float32", seed=args.seed)
    meter = StepPeakMeter()
    runtime_rss = meter.rss_gib()
    t0 = time.perf_counter()
    info = worker.init_distributed("127.0.0.1", port)
    init_s = time.perf_counter() - t0

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    batch = synthetic_batch(args.sequences, args.prompt_len, args.resp_min, args.resp_max, vocab, args.seed)
    per_rank, plan_stats = rank_microbatches(batch, args.world_size, args.max_tokens_per_microbatch)
    mbs = per_rank[rank]
    num_tokens = sum(len(r) for r in batch["response_ids"])
    num_sequences = len(batch["response_ids"])

    step_s, compute_s, steps_memory, metrics = [], [], [], None
    for step in range(1 + args.steps):
        meter.start()
        dist.barrier()
        t0 = time.perf_counter()
        metrics = worker.train_step(mbs, num_tokens, num_sequences).metrics
        dist.barrier()
        seconds = time.perf_counter() - t0
        steps_memory.append(meter.stop())
        if step > 0:
            step_s.append(seconds)
            compute_s.append(metrics["timing/train_compute_s"])
        elif rank == 0:
            print(f"warm-up step: {seconds:.2f}s", flush=True)
    optimizer_bytes = sum((v.to_local() if hasattr(v, "to_local") else v).nbytes
                          for state in worker.optimizer.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor))
    timed = steps_memory[1:]
    queue.put({"rank": rank, "peak_rss_gib": meter.process_peak_gib, "runtime_rss_gib": runtime_rss,
               "rest_rss_gib": timed[0].rest_gib, "step_peak_rss_gib": max(m.peak_gib for m in timed),
               "step_above_rest_gib": max(m.above_rest_gib for m in timed),
               "warmup_step": {"rest_rss_gib": steps_memory[0].rest_gib, "peak_rss_gib": steps_memory[0].peak_gib},
               "optimizer_state_bytes": optimizer_bytes,
               "trainable_parameters": sum(p.numel() for p in worker.optimizer.param_groups[0]["params"])})
    if rank == 0:
        queue.put({
            "init_s": init_s, "num_parameters": info.num_parameters, "step_s": step_s,
            "rank0_compute_s": compute_s, "packed_tokens": metrics["perf/train_tokens"],
            "response_tokens": num_tokens, "sequences": num_sequences,
            "microbatches_per_rank": len(mbs), "tokens_per_rank": [sum(m.num_tokens for m in r) for r in per_rank],
            "plan_stats": {k: float(v) for k, v in plan_stats.items()},
            "last_metrics": {k: float(v) for k, v in metrics.items()},
        })
    worker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="train ranks (processes)")
    parser.add_argument("--strategy", choices=sorted(TRAIN_BACKENDS), default="fsdp", help=(
        "train backend (train.strategy: a name in train_workers.registry.TRAIN_BACKENDS)"))
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="Megatron TP size (strategy megatron)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--sequences", "-N", type=int, default=16, help="sequences per step")
    parser.add_argument("--prompt-len", type=int, default=100, help="mean prompt tokens (±10)")
    parser.add_argument("--resp-min", type=int, default=32)
    parser.add_argument("--resp-max", type=int, default=128)
    parser.add_argument("--kl-coef", type=float, default=0.04, help="> 0 builds and runs the reference policy")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after 1 warm-up step")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-rank", type=int, default=0, help="> 0: a LoRA policy of this rank (train.lora)")
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: = rank)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute the policy's layer activations in the backward "
                        "(train.activation_checkpointing)")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="FSDP2 CPU offload of the policy's shards and AdamW state (train.cpu_offload)")
    parser.add_argument("--quick", action="store_true", help="smoke run: N=4, prompts ~20, responses 8..16, 1 step")
    args = parser.parse_args()
    if args.quick:
        args.sequences, args.prompt_len, args.resp_min, args.resp_max, args.steps = 4, 20, 8, 16, 1

    import torch.multiprocessing as mp

    from weight_sync.group import free_port

    load_start = load_note()
    model_path = resolve_model(args.model)
    print(f"model={model_path}\nstrategy={args.strategy} (tp={args.tensor_parallel_size}), "
          f"world_size={args.world_size} (gloo, {args.threads} thread/rank), "
          f"N={args.sequences}, prompt ~{args.prompt_len}, response U[{args.resp_min},{args.resp_max}], "
          f"kl_coef={args.kl_coef}, lora_rank={args.lora_rank or 'off'}, activation_checkpointing="
          f"{args.activation_checkpointing}, cpu_offload={args.cpu_offload}, max_tokens_per_microbatch="
          f"{args.max_tokens_per_microbatch}, 1 warm-up + {args.steps} timed steps",
          flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    t0 = time.perf_counter()
    mp.spawn(_rank_main, args=(args, model_path, free_port(), queue), nprocs=args.world_size, join=True)
    total_s = time.perf_counter() - t0
    reports = [queue.get() for _ in range(args.world_size + 1)]
    r = next(x for x in reports if "rank" not in x)
    ranks = sorted((x for x in reports if "rank" in x), key=lambda x: x["rank"])

    seconds = statistics.median(r["step_s"])
    tokens = r["packed_tokens"]
    n_params = r["num_parameters"]
    flop_per_token = (6 + (2 if args.kl_coef > 0 else 0)) * n_params
    gflops = flop_per_token * tokens / seconds / 1e9
    print()
    print_table(
        ["ranks", "seqs", "packed tok/step", "resp tok", "mb/rank", "s/step (median)", "min", "max", "tokens/s",
         "GFLOP/s"],
        [[args.world_size, r["sequences"], int(tokens), r["response_tokens"], r["microbatches_per_rank"], seconds,
          min(r["step_s"]), max(r["step_s"]), tokens / seconds, gflops]])
    print(f"\nN_params={n_params / 1e6:.1f}M, {flop_per_token / 1e9:.2f} GFLOP/token "
          f"({'6+2 (policy fwd+bwd, reference fwd)' if args.kl_coef > 0 else '6 (policy fwd+bwd)'}); "
          f"tokens per rank {r['tokens_per_rank']}; init {r['init_s']:.1f}s; whole run {total_s:.0f}s")
    print()
    print_table(["rank", "runtime RSS", "resting RSS", "step peak RSS", "step above rest", "process peak RSS",
                 "AdamW state (MiB)"],
                [[x["rank"], x["runtime_rss_gib"], x["rest_rss_gib"], x["step_peak_rss_gib"], x["step_above_rest_gib"],
                  x["peak_rss_gib"], x["optimizer_state_bytes"] / 2**20] for x in ranks],
                title="memory per rank, GiB (timed steps; AdamW state: the rank's local shard)")
    print(f"trainable parameters {ranks[0]['trainable_parameters']:,}")
    m = r["last_metrics"]
    print(f"last step: loss {m['actor/loss']:.4f}, kl {m['actor/kl']:.2e}, grad_norm {m['actor/grad_norm']:.3f}, "
          f"update_skipped {m['actor/update_skipped']:.0f}")
    load_end = load_note()
    print(f"machine: {load_end['cpus']} CPUs, load average {load_start['loadavg_1m']} at start, "
          f"{load_end['loadavg_1m']} at end (above ~{load_end['cpus']}, other processes shared the cores)")
    print_json("train", {
        "strategy": args.strategy, "tensor_parallel_size": args.tensor_parallel_size,
        "world_size": args.world_size, "threads_per_rank": args.threads, "sequences": r["sequences"],
        "kl_coef": args.kl_coef, "lora_rank": args.lora_rank, "ranks": ranks,
        "activation_checkpointing": args.activation_checkpointing, "cpu_offload": args.cpu_offload,
        "max_tokens_per_microbatch": args.max_tokens_per_microbatch,
        "packed_tokens_per_step": tokens, "response_tokens_per_step": r["response_tokens"],
        "microbatches_per_rank": r["microbatches_per_rank"], "step_seconds": r["step_s"],
        "seconds_per_step": seconds, "tokens_per_s": tokens / seconds, "num_parameters": n_params,
        "gflop_per_s": gflops, "init_s": r["init_s"], "total_s": total_s,
        "machine": {"start": load_start, "end": load_end},
    })


if __name__ == "__main__":
    main()
