"""Time :func:`cluster.loop.scheduler.plan_microbatches` on lognormal sequence lengths; print a table.

Lengths ~ lognormal(mu=6.4, sigma=1.0) tokens (median ≈ 600), clipped to [50, 4000], seed 0; 64 ranks, budget
16384 tokens per micro-batch. Each row: median of 5 wall-clock runs (ms), micro-batches per rank, rank imbalance
(max / min tokens over ranks), and what padded micro-batches would cost instead (padded / packed tokens).

Usage::

    .venv/bin/python -m bench.bench_partition [--world-size 64] [--budget 16384] [--repeats 5]   # from the repo root
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from cluster.loop.scheduler import padded_tokens, plan_microbatches


def lognormal_lengths(n: int, seed: int = 0, lo: int = 50, hi: int = 4000) -> list[int]:
    """n token lengths ~ lognormal(6.4, 1.0) clipped to [lo, hi]."""
    rng = random.Random(seed)
    return [min(hi, max(lo, int(rng.lognormvariate(6.4, 1.0)))) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--budget", type=int, default=16384, help="max tokens per micro-batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    args = parser.parse_args()

    print(f"world_size={args.world_size} budget={args.budget} tokens, median of {args.repeats} runs")
    print(f"{'N':>6} {'ms':>8} {'ms/N (µs)':>10} {'M':>3} {'imbalance':>10} {'tokens/rank':>12} {'padded/packed':>14}")
    for n in args.sizes:
        lengths = lognormal_lengths(n)
        times_ms = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = plan_microbatches(lengths, args.world_size, args.budget)
            times_ms.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times_ms)
        stats = plan.stats(lengths)
        padded = padded_tokens(lengths, (mb for rank in plan.ranks for mb in rank))
        print(f"{n:>6} {ms:>8.1f} {ms / n * 1e3:>10.1f} {plan.num_microbatches:>3} "
              f"{stats['packing/rank_imbalance']:>10.5f} {sum(lengths) // args.world_size:>12} "
              f"{padded / sum(lengths):>14.3f}")


if __name__ == "__main__":
    main()
