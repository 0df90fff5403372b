"""End to end through the scheduler: plan (any order, any token budget, any rank count) → pack → policy forward →
clipped-surrogate + k3 KL loss with global counts → backward gives the same per-sequence logprobs, the same loss and
the same gradients, and every sequence keeps its group id and advantage.

``tests/distributed/test_fsdp_parity.py`` checks the FSDP2 worker on hand-made splits (2 ranks vs 1, 3 micro-batches
vs 1); this file checks what the planner produces from permuted batches and budgets from "one sequence per
micro-batch" (oversize sequences alone) to "everything in one row", in one process with the tiny random Llama
(fp32). Ranks are simulated the way the worker reduces them: each rank backpropagates its micro-batch losses (times
W) and the gradients are averaged over ranks, which in one process is the plain sum of every micro-batch's loss
gradient.

Shapes: N sequences, T = max response length; the batch is B = 5 groups × G = 3.
"""

from __future__ import annotations

import random

import pytest
import torch

from cluster.loop.scheduler import plan_microbatches
from grpo.advantages import compute_advantages
from grpo.losses import policy_loss
from train_workers.packing import pack_rank_microbatches
from train_workers.policy import ResponseLogprobModel

B, G = 5, 3
N = B * G
MAX_RESPONSE_TOKENS = 16
LOSS_AGGS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
# (world_size, max_tokens_per_microbatch, shuffle seed or None): the first is the reference (one row, input order).
LAYOUTS = [(1, 100_000, None), (1, 16, None), (2, 40, 2), (3, 25, 3), (4, 30, 5)]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.use_cache = False
    return model


def make_batch() -> dict:
    """B groups × G sequences (rows grouped in order), random tokens, rewards, behaviour and reference logprobs."""
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    prompts, responses, group_ids = [], [], []
    for group in range(B):
        prompt = torch.randint(3, 49_152, (rng.randint(2, 12),), generator=g).tolist()  # shared by the group
        for _ in range(G):
            prompts.append(prompt)
            responses.append(torch.randint(3, 49_152, (rng.randint(1, MAX_RESPONSE_TOKENS),), generator=g).tolist())
            group_ids.append(group * 10 + 7)  # not 0..B-1: ids are labels, not positions
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in range(N)])
    group_ids = torch.tensor(group_ids)
    return {
        "prompt_ids": prompts, "response_ids": responses, "group_ids": group_ids,
        "advantages": compute_advantages(rewards, group_ids, "grpo"),
        # Behaviour (old) logprobs near the policy's (about −log V ≈ −10.8) so that some ratios clip.
        "behaviour": [-10.8 + 0.3 * torch.randn(len(r), generator=g) for r in responses],
        "reference": [-10.8 + 0.3 * torch.randn(len(r), generator=g) for r in responses],
        "valid_lengths": [max(0, len(r) - (i % 3)) for i, r in enumerate(responses)],  # some masked tails, one 0
    }


def permuted(batch: dict, seed: int | None) -> tuple[dict, list[int]]:
    """The batch with its rows shuffled (``order[k]`` = original row of new row k)."""
    order = list(range(N))
    if seed is not None:
        random.Random(seed).shuffle(order)
    out = {k: [v[i] for i in order] for k, v in batch.items() if isinstance(v, list)}
    out["group_ids"] = batch["group_ids"][order]
    out["advantages"] = batch["advantages"][order]
    return out, order


def run(model: ResponseLogprobModel, batch: dict, world_size: int, budget: int, seed: int | None,
        loss_agg: str) -> dict:
    """One simulated train step; per-sequence results keyed by the ORIGINAL row index."""
    rows, order = permuted(batch, seed)
    lengths = [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"])]
    plan = plan_microbatches(lengths, world_size, budget, oversize="own")
    per_rank = pack_rank_microbatches(plan.ranks, rows["prompt_ids"], rows["response_ids"], rows["advantages"],
                                      rows["behaviour"], rows["valid_lengths"], group_ids=rows["group_ids"])
    num_tokens = sum(rows["valid_lengths"])
    num_sequences = sum(v > 0 for v in rows["valid_lengths"])
    model.zero_grad(set_to_none=True)
    loss_total, logprobs, seen = 0.0, {}, {}
    for mbs in per_rank:
        assert len(mbs) == plan.num_microbatches
        for mb in mbs:
            lp_flat, _ = model(mb.input_ids, mb.position_ids, mb.logit_positions, mb.targets, with_entropy=False)
            if mb.num_sequences == 0:
                (lp_flat.sum() * 0.0).backward()
                continue
            lp = mb.to_padded(lp_flat)
            ref = torch.zeros_like(lp)
            for j, k in enumerate(mb.seq_indices.tolist()):
                ref[j, : len(rows["reference"][k])] = rows["reference"][k]
                original = order[k]
                logprobs[original] = lp[j, : len(rows["response_ids"][k])].detach()
                seen[original] = (int(mb.group_ids[j]), float(mb.advantages[j]))
            loss, _ = policy_loss(lp, mb.behaviour_logprobs, mb.advantages, mb.response_mask, clip_eps_low=0.2,
                                  clip_eps_high=0.28, loss_agg=loss_agg, ref_logprobs=ref, kl_coef=0.05,
                                  kl_estimator="k3", num_tokens=num_tokens, num_sequences=num_sequences,
                                  max_response_tokens=MAX_RESPONSE_TOKENS)
            loss.backward()
            loss_total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss_total, "grads": grads, "logprobs": logprobs, "seen": seen,
            "num_microbatches": plan.num_microbatches}


@pytest.fixture(scope="module")
def results(hf_model) -> dict:
    model = ResponseLogprobModel(hf_model, temperature=0.9)
    batch = make_batch()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is faster, and far faster when other processes load the cores
    try:
        return {agg: [run(model, batch, *layout, agg) for layout in LAYOUTS] for agg in LOSS_AGGS}
    finally:
        torch.set_num_threads(threads)


def test_layouts_really_differ(results):
    counts = [r["num_microbatches"] for r in results[LOSS_AGGS[0]]]
    assert counts[0] == 1 and max(counts) >= N // 2  # from one row to (nearly) one sequence per micro-batch


def test_per_sequence_logprobs_do_not_depend_on_layout(results):
    ref = results[LOSS_AGGS[0]][0]["logprobs"]
    assert sorted(ref) == list(range(N))
    for layout, r in zip(LAYOUTS[1:], results[LOSS_AGGS[0]][1:]):
        assert sorted(r["logprobs"]) == list(range(N))
        for i in range(N):
            torch.testing.assert_close(r["logprobs"][i], ref[i], rtol=0, atol=1e-5, msg=lambda m: f"{layout}: {m}")


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_loss_and_gradients_do_not_depend_on_layout(results, agg):
    ref = results[agg][0]
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    assert scale > 1e-3 and abs(ref["loss"]) > 1e-4  # not trivially zero next to the tolerances
    for layout, r in zip(LAYOUTS[1:], results[agg][1:]):
        assert abs(r["loss"] - ref["loss"]) <= 1e-6 * max(1.0, abs(ref["loss"])), (layout, r["loss"], ref["loss"])
        assert r["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-4, atol=1e-5 * scale,
                                       msg=lambda m: f"{agg} {layout} grad {name}: {m}")


def test_group_ids_and_advantages_follow_their_sequence(results):
    batch = make_batch()
    for layout, r in zip(LAYOUTS, results[LOSS_AGGS[0]]):
        assert sorted(r["seen"]) == list(range(N)), layout
        for i, (gid, adv) in r["seen"].items():
            assert gid == int(batch["group_ids"][i]), (layout, i)
            assert adv == pytest.approx(float(batch["advantages"][i]), abs=0), (layout, i)
