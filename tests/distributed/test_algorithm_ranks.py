"""The policy loss is invariant to how a mini-batch is split: micro-batches of 1, 2 or all sequences, on one process
or on 2 gloo data-parallel ranks, give the same loss and the same gradients (within 1e-6) for every policy loss
(``algorithm.policy_loss``: ppo, gspo, gspo_token, cispo) and every aggregation.

Model: a tiny linear LM head (features [N, T, H] → logits [N, T, V]) whose weight is the only parameter; the loss is
``grpo.losses.policy_loss`` with every term on (clip-higher, dual clip but with cispo, which refuses it, k3 KL, entropy
bonus with gradient, truncated importance weights) and the global token/sequence counts. The proximal ("old") logprobs
differ from the current ones, so the ratios (GSPO's per sequence) clip for some sequences. Data-parallel reduction as in
the FSDP2 worker: each rank backpropagates world_size × its micro-batch losses and gradients are averaged over ranks
(FSDP's reduce-scatter average), so the average of the scaled per-rank sums is the full-batch gradient.
"""

from __future__ import annotations

from typing import get_args

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo.logprobs import entropy_from_logits, logprobs_from_logits
from grpo.losses import LossAggregationName, policy_loss, truncated_importance_weights
from grpo.policy_losses import PolicyLossName, supports_dual_clip

AGGS = list(get_args(LossAggregationName))
MODES = list(get_args(PolicyLossName))
CASES = [(mode, agg) for mode in MODES for agg in AGGS]
N, T, H, V = 6, 7, 5, 11
TOL = 1e-6
RANK_ROWS = [[0, 1, 2], [3, 4, 5]]  # uneven token counts: lengths differ per row


def make_data():
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor([7, 1, 4, 0, 6, 3])  # row 3 has no valid token
    return dict(
        features=torch.randn(N, T, H, generator=g) * 0.5,  # gradients of order 0.1-1
        weight=torch.randn(H, V, generator=g) * 0.5,
        targets=torch.randint(0, V, (N, T), generator=g),
        mask=torch.arange(T)[None] < lengths[:, None],
        old=-torch.rand(N, T, generator=g) * 2 - 0.5,
        engine=-torch.rand(N, T, generator=g) * 2 - 0.5,
        ref=-torch.rand(N, T, generator=g) * 2 - 0.5,
        adv=torch.randn(N, generator=g),
    )


def loss_of(weight: torch.Tensor, data: dict, rows: list[int], agg: str, mode: str) -> torch.Tensor:
    idx = torch.tensor(rows)
    logits = data["features"][idx] @ weight
    logp = logprobs_from_logits(logits, data["targets"][idx], temperature=0.7)
    ent = entropy_from_logits(logits, temperature=0.7)
    mask = data["mask"][idx]
    tis = truncated_importance_weights(data["old"][idx], data["engine"][idx], mask, cap=1.5)
    loss, _ = policy_loss(
        logp, data["old"][idx], data["adv"][idx], mask, clip_eps_low=0.2, clip_eps_high=0.28,
        dual_clip_c=3.0 if supports_dual_clip(mode) else None, loss_agg=agg, loss_mode=mode,
        ref_logprobs=data["ref"][idx], kl_coef=0.05, kl_estimator="k3", entropy=ent, entropy_coef=0.01,
        tis_weights=tis, num_tokens=int(data["mask"].sum()), num_sequences=int(data["mask"].any(-1).sum()),
        max_response_tokens=T)
    return loss


def split_run(data: dict, rows: list[int], size: int, agg: str, scale: float,
              mode: str = "ppo") -> tuple[float, torch.Tensor]:
    """Σ micro-batch losses and the accumulated gradient of scale × each micro-batch loss."""
    weight = data["weight"].clone().requires_grad_()
    total = 0.0
    for start in range(0, len(rows), size):
        loss = loss_of(weight, data, rows[start:start + size], agg, mode)
        (loss * scale).backward()
        total += float(loss.detach())
    return total, weight.grad


def _rank_main(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    data = make_data()
    results = {}
    for mode, agg in CASES:
        for size in (1, 2, len(RANK_ROWS[rank])):
            loss, grad = split_run(data, RANK_ROWS[rank], size, agg, scale=float(world), mode=mode)
            loss_t = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(loss_t)
            dist.all_reduce(grad)
            results[(mode, agg, size)] = (float(loss_t), grad / world)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("algorithm_ranks")
    out = tmp / "results.pt"
    mp.spawn(_rank_main, args=(2, str(tmp / "init"), str(out)), nprocs=2, join=True)
    return torch.load(out)


@pytest.mark.parametrize("mode, agg", CASES)
def test_micro_batches_on_one_process_match_the_full_batch(mode, agg):
    data = make_data()
    full_loss, full_grad = split_run(data, list(range(N)), N, agg, scale=1.0, mode=mode)
    assert full_grad.abs().max() > 0.1  # the gradient is not trivially small next to the tolerance
    for size in (1, 2, 4):
        loss, grad = split_run(data, list(range(N)), size, agg, scale=1.0, mode=mode)
        assert abs(loss - full_loss) <= TOL, (agg, size, loss, full_loss)
        torch.testing.assert_close(grad, full_grad, atol=TOL, rtol=0)


@pytest.mark.parametrize("mode, agg", CASES)
def test_two_gloo_ranks_match_the_full_batch(mode, agg, two_rank_results):
    data = make_data()
    full_loss, full_grad = split_run(data, list(range(N)), N, agg, scale=1.0, mode=mode)
    for size in (1, 2, 3):
        loss, grad = two_rank_results[(mode, agg, size)]
        assert abs(loss - full_loss) <= TOL, (agg, size, loss, full_loss)
        torch.testing.assert_close(grad, full_grad, atol=TOL, rtol=0)


@pytest.mark.parametrize("agg", AGGS)
def test_the_policy_losses_differ_on_this_batch(agg):
    """The invariance above is not one loss seen four times: on this batch (proximal ≠ current policy, token-level
    TIS weights) every two modes' gradients differ."""
    data = make_data()
    grads = {mode: split_run(data, list(range(N)), N, agg, scale=1.0, mode=mode)[1] for mode in MODES}
    for i, a in enumerate(MODES):
        for b in MODES[i + 1:]:
            assert (grads[a] - grads[b]).abs().max() > 1e-3, (a, b)
