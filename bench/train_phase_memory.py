"""Where a train rank's memory goes within one GRPO step: RSS and peak RSS around each engine call (Linux).

Two FSDP2 ranks over gloo (one thread each) train on ``bench_train``'s synthetic demo batch (32 sequences, prompts
≈ 72 tokens, responses 16..128, 1,024-token micro-batches, ``kl_coef`` 0.04). Each call of the rank's
:class:`~train_workers.fsdp_engine.FSDPEngine` (``reference_logprobs``, ``policy_forward``, ``backward``,
``clip_gradients``, ``optimizer_step``, ``zero_grad``) is wrapped: the RSS before it, the peak RSS during it (``VmHWM``
reset through ``/proc/self/clear_refs`` first, as in ``bench._memory``) and the RSS after it, in GiB, and its seconds.
Step 0 is the warm-up (AdamW's state is created in it); the step line gives its resting RSS (after ``malloc_trim``), the
largest per-call peak and its seconds. Used for the component list in docs/results.md (activation checkpointing).

Usage (from the repo root; heavy: run under ``flock /tmp/grpo-heavy.lock``)::

    .venv/bin/python -m bench.train_phase_memory --activation-checkpointing           # the lean paths (CPU)
    .venv/bin/python -m bench.train_phase_memory --activation-checkpointing --speed-paths   # without them
    .venv/bin/python -m bench.train_phase_memory --activation-checkpointing --mmap-threshold 1048576
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

CALLS = ("reference_logprobs", "policy_forward", "backward", "clip_gradients", "optimizer_step", "zero_grad")


def _status_gib() -> dict[str, float]:
    """``{"VmRSS": GiB, "VmHWM": GiB}`` of this process."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(rest.split()[0]) / 2**20
    return out


def _wrap(engine, name: str, log: list) -> None:
    """Replace ``engine.<name>`` by a call that appends (name, RSS before, peak during, RSS after, seconds) to
    ``log``."""
    call = getattr(engine, name)

    def measured(*args, **kwargs):
        before = _status_gib()["VmRSS"]
        Path("/proc/self/clear_refs").write_text("5")
        t0 = time.perf_counter()
        out = call(*args, **kwargs)
        after = _status_gib()
        log.append((name, round(before, 3), round(after["VmHWM"], 3), round(after["VmRSS"], 3),
                    round(time.perf_counter() - t0, 2)))
        return out

    setattr(engine, name, measured)


def _rank_main(rank: int, args: argparse.Namespace, model_path: str, port: int, queue) -> None:
    """One train rank: build the worker as the train pool does, wrap its engine, run the steps, report the log."""
    if args.mmap_threshold:
        import ctypes
        import ctypes.util

        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, args.mmap_threshold)  # -3: M_MMAP_THRESHOLD
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoConfig

    from bench.bench_train import rank_microbatches, synthetic_batch
    from cluster.spec import AlgorithmSpec, TrainSpec
    from train_workers.fsdp_worker import FSDPTrainWorker
    from train_workers.host_memory import release_free_heap

    train = TrainSpec(world_size=2, num_threads=1, backend="gloo", max_tokens_per_microbatch=1024,
                      activation_checkpointing=args.activation_checkpointing)
    worker = FSDPTrainWorker(rank, 2, model_path, train, AlgorithmSpec(kl_coef=0.04), temperature=1.0,
                             max_response_tokens=128, dtype="float32", seed=0)
    if args.speed_paths:
        worker._cpu_lean = False
    worker.init_distributed("127.0.0.1", port)
    log: list = []
    for name in CALLS:
        _wrap(worker.engine, name, log)
    batch = synthetic_batch(32, 72, 16, 128, AutoConfig.from_pretrained(model_path).vocab_size, 0)
    microbatches = rank_microbatches(batch, 2, 1024)[0][rank]
    num_tokens = sum(len(r) for r in batch["response_ids"])
    for step in range(1 + args.steps):
        release_free_heap()
        first, rest = len(log), _status_gib()["VmRSS"]
        dist.barrier()
        t0 = time.perf_counter()
        worker.train_step(microbatches, num_tokens, 32)
        dist.barrier()
        peak = max(row[2] for row in log[first:])
        seconds = round(time.perf_counter() - t0, 1)
        log.insert(first, (f"step {step}: rest / peak GiB, s", round(rest, 3), peak, seconds))
    queue.put((rank, log))
    worker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--activation-checkpointing", action="store_true", help="train.activation_checkpointing")
    parser.add_argument("--speed-paths", action="store_true",
                        help="with checkpointing, keep the CPU speed paths (no lean memory paths)")
    parser.add_argument("--mmap-threshold", type=int, default=0,
                        help="> 0: glibc mallopt(M_MMAP_THRESHOLD, bytes) in each rank before anything is built")
    parser.add_argument("--steps", type=int, default=1, help="steps after the warm-up step")
    args = parser.parse_args()

    import torch.multiprocessing as mp

    from bench._common import DEFAULT_MODEL, resolve_model
    from weight_sync.group import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(args, resolve_model(DEFAULT_MODEL), free_port(), queue), nprocs=2, join=True)
    for rank, log in sorted(queue.get() for _ in range(2)):
        print(f"rank {rank} ({vars(args)}): call, RSS before, peak during, RSS after (GiB), seconds")
        for row in log:
            print("  ", *row)


if __name__ == "__main__":
    main()
