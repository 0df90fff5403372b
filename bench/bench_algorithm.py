"""Per-step overhead of the pure algorithm core (``grpo/``) on a realistic batch; prints a table in ms.

Batch: B = 8 prompts × G = 8 completions = N = 64 sequences of up to T = 512 response tokens (lengths uniform in
[64, 512], seed 0), float32 on the CPU. Timed, median of ``--repeats`` runs after one warm-up:

- rewards: the builtin GSM8K accuracy + format functions on 64 completions (``combine_rewards``);
- advantages: both rewards, grpo estimator, sum-then-normalise and normalise-then-sum;
- loss: ``policy_loss`` forward + backward on [N, T] logprobs with every term on (clip-higher, dual clip, k3 KL,
  entropy bonus, truncated importance weights, KL-in-reward advantages), for each aggregation;
- step total: rewards + advantages + loss (seq-mean-token-mean).

The model's forward/backward, generation and weight sync are not included: they are what this overhead is compared
with (seconds per step; see bench_train / bench_rollout).

Usage::

    .venv/bin/python -m bench.bench_algorithm [--repeats 20] [--n 64] [--t 512]   # from the repo root
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from bench._common import print_json, print_table
from grpo.advantages import compute_multi_reward_advantages
from grpo.kl import kl_penalty, kl_reward_advantages
from grpo.losses import LOSS_AGGREGATIONS, policy_loss, truncated_importance_weights
from grpo.rewards import combine_rewards


def make_batch(n: int, t: int, group_size: int = 8, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min(64, t), t + 1, (n,), generator=g)
    logp = -torch.rand(n, t, generator=g) * 3
    answers = torch.randint(0, 100, (n,), generator=g).tolist()
    return {
        "mask": torch.arange(t)[None] < lengths[:, None],
        "logp": logp,
        "old": logp + torch.randn(n, t, generator=g) * 0.05,
        "engine": logp + torch.randn(n, t, generator=g) * 0.01,
        "ref": logp + torch.randn(n, t, generator=g) * 0.1,
        "entropy": torch.rand(n, t, generator=g) * 2,
        "group_ids": torch.arange(n) // group_size,
        "completions": [f"Some reasoning about the problem, step by step.\n#### {a}" for a in answers],
        "references": [f"Worked answer.\n#### {a if i % 3 else a + 1}" for i, a in enumerate(answers)],
    }


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median wall-clock milliseconds of fn() over `repeats` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--n", type=int, default=64, help="sequences N")
    parser.add_argument("--t", type=int, default=512, help="max response tokens T")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a train rank uses 1 on CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b = make_batch(args.n, args.t)
    weights = {"accuracy": 1.0, "format": 0.2}

    def rewards():
        return combine_rewards(b["completions"], b["references"], weights)

    per_function = rewards().per_function

    def advantages(combine: str):
        return compute_multi_reward_advantages(per_function, weights, b["group_ids"], "grpo", combine=combine)

    adv = advantages("sum-then-normalise")

    def loss(agg: str):
        logp = b["logp"].clone().requires_grad_()
        ent = b["entropy"].clone().requires_grad_()
        tis = truncated_importance_weights(b["old"], b["engine"], b["mask"], cap=2.0)
        token_adv = kl_reward_advantages(adv, kl_penalty(b["old"], b["ref"]), b["mask"], 0.04)
        out, _ = policy_loss(logp, b["old"], token_adv, b["mask"], clip_eps_low=0.2, clip_eps_high=0.28,
                             dual_clip_c=3.0, loss_agg=agg, ref_logprobs=b["ref"], kl_coef=0.04, entropy=ent,
                             entropy_coef=0.001, tis_weights=tis, max_response_tokens=args.t)
        out.backward()

    rows = [["rewards (accuracy + format)", timed(rewards, args.repeats)]]
    for combine in ("sum-then-normalise", "normalise-then-sum"):
        rows.append([f"advantages ({combine})", timed(lambda: advantages(combine), args.repeats)])
    for agg in LOSS_AGGREGATIONS:
        rows.append([f"loss fwd+bwd ({agg})", timed(lambda: loss(agg), args.repeats)])

    def step():
        rewards()
        advantages("sum-then-normalise")
        loss("seq-mean-token-mean")

    total = timed(step, args.repeats)
    rows.append(["step total", total])
    print_table(["part", "ms"], rows, title=f"algorithm core, N={args.n} T={args.t}, {args.threads} thread(s), "
                                            f"median of {args.repeats}")
    print_json("algorithm", {"n": args.n, "t": args.t, "threads": args.threads, "step_ms": total,
                             **{name: ms for name, ms in rows}})


if __name__ == "__main__":
    main()
