"""Masked and sequence-level importance sampling (``algorithm.mis``, ``algorithm.tis_level``, issue 17) in the FSDP2
train step on the tiny Llama over gloo (one rank, the batch of ``test_algorithm_trainer``: 4 + 2 + 0 + 6 loss tokens
in two micro-batches).

The engine's logprobs are made from the trainer's own: behaviour = trainer logprob + offset, so the importance ratio
trainer/engine of each token is exp(−offset), chosen per token. With one iteration, kl_coef 0 and no entropy bonus
the ratio π_θ/π_old is 1, so every kept token's pg term is −A and the token-mean loss is
−Σ_kept A / (kept tokens): computed by hand below, with and without MIS.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.test_algorithm_trainer import ADVANTAGES, MAX_RESPONSE_TOKENS, VALID, microbatches
from weight_sync.group import free_ports

#: Per sequence (response lengths 4, 5, 8, 6), engine logprob − trainer logprob of each response token.
OFFSETS = [[0.0, 2.0, 0.0, -2.0], [0.1, 0.1, 5.0, 5.0, 5.0], [0.0] * 8, [0.0, 0.0, 0.0, 0.0, 0.0, 3.0]]
BASE = {"kl_coef": 0.0, "loss_agg": "token-mean"}


def _rank_main(rank: int, model_dir: str, ports: list[int], runs: list[dict], out_dir: str) -> None:
    import train_workers.grpo_step as grpo_step
    import train_workers.fsdp_worker as fw
    from cluster.spec import AlgorithmSpec, TrainSpec

    torch.set_num_threads(1)
    calls: list[dict] = []
    original = grpo_step.policy_loss

    def recording_policy_loss(logprobs, old_logprobs, advantages, mask, **kwargs):
        calls.append({"mask": mask.clone(), "num_tokens": kwargs["num_tokens"],
                      "num_sequences": kwargs["num_sequences"], "tis_weights": kwargs["tis_weights"]})
        return original(logprobs, old_logprobs, advantages, mask, **kwargs)

    grpo_step.policy_loss = recording_policy_loss
    train = TrainSpec(world_size=1, num_threads=1, lr=1e-3, max_grad_norm=1.0, timeout_s=120)
    for run, port in zip(runs, ports):
        calls.clear()
        worker = fw.FSDPTrainWorker(0, 1, model_dir, train, AlgorithmSpec(**run["algorithm"]), 0.8,
                                    MAX_RESPONSE_TOKENS, dtype="float32", seed=0)
        worker.init_distributed("127.0.0.1", port)
        batch = []
        for mb, offsets in zip(microbatches(), (OFFSETS[:2], OFFSETS[2:])):
            with torch.no_grad():
                own = mb.to_padded(worker.policy(*worker.engine.inputs(mb), with_entropy=False)[0].float())
            shift = torch.zeros_like(own)
            for i, row in enumerate(offsets):
                shift[i, :len(row)] = torch.tensor(row)
            batch.append(dataclasses.replace(mb, behaviour_logprobs=torch.where(mb.response_mask, own + shift, 0.0)))
        result = worker.train_step(batch, sum(VALID), sum(v > 0 for v in VALID))
        torch.save({"metrics": result.metrics, "calls": list(calls)}, f"{out_dir}/{run['name']}.pt")
        worker.shutdown()


def _k3(log_r: float) -> float:
    return math.expm1(log_r) - log_r


def test_async_mis_and_sequence_tis_in_the_train_step(tiny_model_dir, tmp_path):
    runs = [
        {"name": "off", "algorithm": BASE},
        {"name": "token", "algorithm": {**BASE, "mis": {"level": "token", "low": 0.5, "high": 2.0}}},
        {"name": "sequence", "algorithm": {**BASE, "mis": {"level": "sequence", "low": 0.7, "high": 1.5},
                                           "tis_cap": 1.5, "tis_level": "sequence"}},
    ]
    ports = free_ports(len(runs))
    mp.spawn(_rank_main, args=(tiny_model_dir, ports, runs, str(tmp_path)), nprocs=1, join=True)
    res = {run["name"]: torch.load(tmp_path / f"{run['name']}.pt") for run in runs}
    a = ADVANTAGES

    # No correction: every valid token, the driver's counts, today's metrics only.
    off = res["off"]
    assert off["metrics"]["actor/loss"] == pytest.approx(-(4 * a[0] + 2 * a[1] + 6 * a[3]) / 12, abs=1e-6)
    assert [(c["num_tokens"], c["num_sequences"]) for c in off["calls"]] == [(12, 3)] * 2
    assert not any(k.startswith(("actor/mis", "actor/behaviour", "actor/kl_behaviour")) for k in off["metrics"])

    # Token MIS, band [0.5, 2]: ratios exp(−offset); dropped: sequence 0 tokens 1 (e^−2) and 3 (e^2), sequence 3
    # token 5 (e^−3). 9 kept tokens in 3 sequences leave the numerator and the denominator.
    token = res["token"]
    keep0 = torch.tensor([[1, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    keep1 = torch.zeros(2, 8, dtype=torch.bool)
    keep1[1, :5] = True
    assert torch.equal(token["calls"][0]["mask"], keep0[:, :token["calls"][0]["mask"].shape[1]])
    assert torch.equal(token["calls"][1]["mask"], keep1[:, :token["calls"][1]["mask"].shape[1]])
    assert [(c["num_tokens"], c["num_sequences"]) for c in token["calls"]] == [(9, 3)] * 2
    m = token["metrics"]
    assert m["actor/loss"] == pytest.approx(-(2 * a[0] + 2 * a[1] + 5 * a[3]) / 9, abs=1e-6)
    assert m["actor/loss"] != pytest.approx(off["metrics"]["actor/loss"], abs=1e-3)
    assert m["actor/mis_masked_fraction"] == 3 / 12
    assert m["actor/behaviour_ratio_min"] == pytest.approx(math.exp(-3.0), rel=1e-4)
    assert m["actor/behaviour_ratio_max"] == pytest.approx(math.exp(2.0), rel=1e-4)
    # geometric means: sequence 0 exp(0) = 1, sequence 1 exp(−0.1), sequence 3 exp(−3/6)
    assert m["actor/behaviour_seq_ratio_min"] == pytest.approx(math.exp(-0.5), rel=1e-4)
    assert m["actor/behaviour_seq_ratio_max"] == pytest.approx(1.0, abs=1e-4)
    kl = (_k3(-2.0) + _k3(2.0) + 2 * _k3(-0.1) + _k3(-3.0)) / 12
    assert m["actor/kl_behaviour_current"] == pytest.approx(kl, rel=1e-4)

    # Sequence MIS, band [0.7, 1.5]: sequence 3 (geometric mean e^−0.5 = 0.61) is dropped whole; sequence-level TIS
    # weights exp(Σ log ρ) capped at 1.5: sequence 0 e^0 = 1, sequence 1 e^−0.2.
    seq = res["sequence"]
    assert [(c["num_tokens"], c["num_sequences"]) for c in seq["calls"]] == [(6, 2)] * 2
    assert not seq["calls"][1]["mask"].any()
    assert seq["metrics"]["actor/loss"] == pytest.approx(-(4 * a[0] * 1.0 + 2 * a[1] * math.exp(-0.2)) / 6,
                                                         abs=1e-5)
    assert seq["metrics"]["actor/mis_masked_fraction"] == 6 / 12
    w = seq["calls"][0]["tis_weights"]
    assert w[0, :4].tolist() == pytest.approx([1.0] * 4, abs=1e-5)
    assert w[1, :2].tolist() == pytest.approx([math.exp(-0.2)] * 2, rel=1e-5)
    assert seq["metrics"]["actor/tis_weight_mean"] == pytest.approx((4 + 2 * math.exp(-0.2)) / 6, rel=1e-5)
