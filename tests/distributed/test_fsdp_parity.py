"""FSDP2 train worker over gloo: a 2-rank step equals a 1-rank step on the whole batch, and the loss and update do
not depend on how a rank's sequences are split into micro-batches.

Every run is one ``FSDPTrainWorker`` (the real class the Ray pool wraps) built from the real spec models; the ranks
are ``torch.multiprocessing.spawn`` processes. Several runs share one spawn: after a run the worker destroys its
process group and the next worker builds a fresh one (fresh model, fresh optimizer) on a new port.

Batch: N = 6 sequences with fixed random prompt/response tokens and nonzero advantages. Compared: the loss and metrics,
the (clipped) full gradients the optimizer sees, and the parameters after one AdamW step. The step moves every trained
tensor by about lr = 1e-4, ten times the 1e-5 parameter tolerance. (A larger lr does not make the parameter check
stronger: AdamW's first step is lr·g/(|g| + 1e-8), so it ignores gradient scale, which the gradient and grad-norm checks
cover, and it amplifies float rounding of gradients near 1e-8 by lr/1e-8; at lr 1e-3 that alone reached 1.2e-5.)
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.multiprocessing as mp

from train_workers.packing import empty_microbatch, pack_microbatch
from weight_sync.group import free_ports

ATOL = 1e-5
N = 6
MAX_RESPONSE_TOKENS = 8
TEMPERATURE = 0.8
ADVANTAGES = [1.0, -1.0, 0.5, 1.5, -0.25, 2.0]
LOSS_AGGS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]


def make_batch():
    g = torch.Generator().manual_seed(1234)
    prompt_lens, response_lens = [5, 3, 8, 4, 6, 2], [4, 8, 2, 6, 3, 5]
    prompts = [torch.randint(0, 49_152, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(0, 49_152, (n,), generator=g).tolist() for n in response_lens]
    behaviour = [-torch.rand(n, generator=g) for n in response_lens]
    return prompts, responses, behaviour


def pack(indices):
    prompts, responses, behaviour = make_batch()
    if not indices:
        return empty_microbatch()
    return pack_microbatch([prompts[i] for i in indices], [responses[i] for i in indices],
                           [ADVANTAGES[i] for i in indices], [behaviour[i] for i in indices], indices)


def _full_params(worker) -> dict[str, torch.Tensor]:
    """Full (gathered) parameters in HF names; a collective, every rank calls it."""
    from train_workers.sharding import full_tensor

    return {name: full_tensor(p).detach().clone() for name, p in worker.policy.model.named_parameters()}


def _capture_grads(worker, into: dict) -> None:
    """Record the full gradients each time the optimizer steps (after clipping), then step as usual."""
    from train_workers.sharding import full_tensor

    step = worker.optimizer.step

    def recording_step(*args, **kwargs):
        into.update({n: full_tensor(p.grad).detach().clone() for n, p in worker.policy.model.named_parameters()})
        return step(*args, **kwargs)

    worker.optimizer.step = recording_step


def _ranks_main(rank: int, world: int, model_dir: str, ports: list[int], runs: list[dict], out_dir: str):
    """One spawned rank: for each run, a fresh worker, one train_step on this rank's micro-batches, gathered
    parameters and metrics saved by rank 0 to ``out_dir/<run name>.pt``."""
    from cluster.spec import AlgorithmSpec, TrainSpec
    from train_workers.fsdp_worker import FSDPTrainWorker

    torch.set_num_threads(1)
    train = TrainSpec(world_size=world, num_threads=1, lr=1e-4, max_grad_norm=1.0, timeout_s=120)
    _, responses, _ = make_batch()
    num_tokens = sum(len(r) for r in responses)
    for run, port in zip(runs, ports):
        algorithm = AlgorithmSpec(kl_coef=0.04, loss_agg=run["loss_agg"])
        worker = FSDPTrainWorker(rank, world, model_dir, train, algorithm, TEMPERATURE, MAX_RESPONSE_TOKENS,
                                 dtype="float32", seed=0)
        info = worker.init_distributed("127.0.0.1", port)
        assert info.backend == "gloo"
        before = _full_params(worker) if run.get("save_initial") else None
        grads: dict[str, torch.Tensor] = {}
        _capture_grads(worker, grads)
        result = worker.train_step([pack(idx) for idx in run["microbatches"][rank]], num_tokens, N)
        after = _full_params(worker)
        if rank == 0:
            torch.save({"result": asdict(result), "metrics": result.metrics, "params": after, "initial": before,
                        "grads": grads}, f"{out_dir}/{run['name']}.pt")
        worker.shutdown()


def spawn(world: int, model_dir: str, runs: list[dict], out_dir) -> dict[str, dict]:
    ports = free_ports(len(runs))
    mp.spawn(_ranks_main, args=(world, model_dir, ports, runs, str(out_dir)), nprocs=world, join=True)
    return {run["name"]: torch.load(out_dir / f"{run['name']}.pt") for run in runs}


def expected_loss(loss_agg: str) -> float:
    """At the first step the policy is the behaviour and reference policy: ratio 1, KL 0, clipped term inactive, so
    the per-token loss is −A and the aggregation alone decides the value (``grpo.losses`` formulas)."""
    _, responses, _ = make_batch()
    lengths = [len(r) for r in responses]
    if loss_agg == "seq-mean-token-mean":
        return -sum(ADVANTAGES) / N
    token_sum = -sum(a * n for a, n in zip(ADVANTAGES, lengths))
    if loss_agg == "token-mean":
        return token_sum / sum(lengths)
    return token_sum / (N * MAX_RESPONSE_TOKENS)


def assert_same_params(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=ATOL, msg=lambda m: f"{what}: {name}: {m}")


def assert_same_grads(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys() and a
    scale = max(float(g.abs().max()) for g in b.values())
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6 * scale,
                                   msg=lambda m: f"{what}: grad of {name}: {m}")


def assert_same_metrics(a: dict, b: dict, what: str) -> None:
    for key in ("actor/loss", "actor/kl", "actor/clip_fraction", "actor/entropy", "actor/grad_norm",
                "rollout/logprob_diff", "actor/ratio_mean"):
        assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), f"{what}: {key} {a[key]} vs {b[key]}"


def test_two_ranks_match_one_rank_and_microbatch_split_is_invisible(tiny_model_dir, tmp_path):
    # Two ranks: rank 0 gets sequences {0, 1, 2} in two micro-batches, rank 1 gets {3, 4, 5} in one micro-batch plus
    # the placeholder that keeps the micro-batch counts equal.
    two = spawn(2, tiny_model_dir, [
        {"name": f"two_{agg}", "loss_agg": agg, "microbatches": [[[0, 1], [2]], [[3, 4, 5], []]]}
        for agg in LOSS_AGGS
    ], tmp_path)
    # One rank: the whole batch in one micro-batch, and in three uneven micro-batches.
    one = spawn(1, tiny_model_dir, [
        {"name": f"whole_{agg}", "loss_agg": agg, "microbatches": [[list(range(N))]], "save_initial": True}
        for agg in LOSS_AGGS
    ] + [
        {"name": f"split_{agg}", "loss_agg": agg, "microbatches": [[[4], [0, 5, 2], [1, 3]]]}
        for agg in LOSS_AGGS
    ], tmp_path)

    for agg in LOSS_AGGS:
        whole, split, ranks2 = one[f"whole_{agg}"], one[f"split_{agg}"], two[f"two_{agg}"]
        m = whole["metrics"]
        assert whole["result"]["policy_version"] == 1 and not whole["result"]["skipped"]
        assert m["actor/update_skipped"] == 0.0
        assert abs(m["actor/loss"] - expected_loss(agg)) < 1e-5, (agg, m["actor/loss"], expected_loss(agg))
        assert abs(m["actor/kl"]) < 1e-6 and m["actor/clip_fraction"] == 0.0
        assert abs(m["actor/ratio_mean"] - 1.0) < 1e-6
        assert m["actor/grad_norm"] > 0 and m["actor/entropy"] > 0
        # The update is visible: every trained tensor moved by about lr.
        moved = {n: float((whole["params"][n] - whole["initial"][n]).abs().max()) for n in whole["params"]}
        assert all(v > 5e-5 for v in moved.values()), moved
        assert whole["grads"] and all(float(g.abs().max()) > 0 for g in whole["grads"].values())
        assert_same_metrics(split["metrics"], m, f"{agg}: 3 micro-batches vs 1")
        assert_same_grads(split["grads"], whole["grads"], f"{agg}: 3 micro-batches vs 1")
        assert_same_params(split["params"], whole["params"], f"{agg}: 3 micro-batches vs 1")
        assert_same_metrics(ranks2["metrics"], m, f"{agg}: 2 ranks vs 1")
        assert ranks2["result"]["policy_version"] == 1
        assert_same_grads(ranks2["grads"], whole["grads"], f"{agg}: 2 ranks vs 1")
        assert_same_params(ranks2["params"], whole["params"], f"{agg}: 2 ranks vs 1")
