"""The FSDP2 train worker's algorithm options on the tiny Llama over gloo (one rank): ``num_iterations`` > 1 reuses
the behaviour logprobs recorded before the first update, one iteration keeps the detached-current shortcut, and KL in
the reward, truncated importance sampling, dual clip, EOS/truncation masks and the adaptive β reach the loss.

``grpo.losses.policy_loss`` is wrapped inside the spawned rank to record what the worker passes it.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from train_workers.packing import pack_microbatch
from weight_sync.group import free_ports

MAX_RESPONSE_TOKENS = 8
ADVANTAGES = [1.0, -1.0, 0.5, -0.5]
VALID = [4, 2, 0, 6]  # sequence 1 stops at an EOS after 2 tokens; sequence 2 is a masked truncated completion


def microbatches(nan_engine_logprob: bool = False):
    g = torch.Generator().manual_seed(99)
    prompts = [torch.randint(0, 49_152, (n,), generator=g).tolist() for n in (5, 3, 4, 6)]
    responses = [torch.randint(0, 49_152, (n,), generator=g).tolist() for n in (4, 5, 8, 6)]
    behaviour = [-torch.rand(len(r), generator=g) - 19.0 for r in responses]  # far below the policy's ≈ −10.8
    if nan_engine_logprob:
        behaviour[0][1] = float("nan")  # a valid token (sequence 0 has 4 loss tokens)
    pack = lambda idx: pack_microbatch([prompts[i] for i in idx], [responses[i] for i in idx],  # noqa: E731
                                       [ADVANTAGES[i] for i in idx], [behaviour[i] for i in idx], idx,
                                       valid_lengths=[VALID[i] for i in idx])
    return [pack([0, 1]), pack([2, 3])]


def _rank_main(rank: int, model_dir: str, ports: list[int], runs: list[dict], out_dir: str) -> None:
    import train_workers.grpo_step as grpo_step
    import train_workers.fsdp_worker as fw
    from cluster.spec import AlgorithmSpec, TrainSpec

    torch.set_num_threads(1)
    calls: list[dict] = []
    original = grpo_step.policy_loss

    def recording_policy_loss(logprobs, old_logprobs, advantages, mask, **kwargs):
        calls.append({"logprobs": logprobs.detach().clone(), "old": old_logprobs.detach().clone(),
                      "advantages": advantages.detach().clone(), "mask": mask.clone(), **{
                          k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()
                          if k in ("kl_coef", "tis_weights", "dual_clip_c")}})
        return original(logprobs, old_logprobs, advantages, mask, **kwargs)

    grpo_step.policy_loss = recording_policy_loss
    train = TrainSpec(world_size=1, num_threads=1, lr=1e-3, max_grad_norm=1.0, timeout_s=120)
    for run, port in zip(runs, ports):
        calls.clear()
        worker = fw.FSDPTrainWorker(0, 1, model_dir, train, AlgorithmSpec(**run["algorithm"]), 0.8,
                                    MAX_RESPONSE_TOKENS, dtype="float32", seed=0)
        worker.init_distributed("127.0.0.1", port)
        if "set_kl_coef" in run:
            worker.set_kl_coef(run["set_kl_coef"])
        result = worker.train_step(microbatches(run.get("nan_engine_logprob", False)), sum(VALID),
                                   sum(v > 0 for v in VALID))
        torch.save({"metrics": result.metrics, "policy_version": result.policy_version, "calls": list(calls)},
                   f"{out_dir}/{run['name']}.pt")
        worker.shutdown()


def run_all(model_dir: str, runs: list[dict], out_dir) -> dict:
    ports = free_ports(len(runs))
    mp.spawn(_rank_main, args=(model_dir, ports, runs, str(out_dir)), nprocs=1, join=True)
    return {run["name"]: torch.load(out_dir / f"{run['name']}.pt") for run in runs}


def masked_max_diff(a, b, mask):
    return float(torch.where(mask, (a - b).abs(), 0.0).max())


def test_algorithm_options_in_the_train_worker(tiny_model_dir, tmp_path):
    results = run_all(tiny_model_dir, [
        {"name": "one", "algorithm": {"kl_coef": 0.04}},
        {"name": "two", "algorithm": {"kl_coef": 0.04, "num_iterations": 2}},
        {"name": "options", "set_kl_coef": 0.1, "algorithm": {
            "kl_coef": 0.04, "kl_in_reward": True, "tis_cap": 1.5, "dual_clip_c": 3.0, "entropy_coef": 0.01,
            "num_iterations": 2, "loss_agg": "token-mean"}},
        {"name": "nan", "nan_engine_logprob": True, "algorithm": {"kl_coef": 0.04, "tis_cap": 1.5}},
    ], tmp_path)

    # One iteration: the behaviour logprobs are the current policy's, from the same forward pass.
    one = results["one"]
    assert len(one["calls"]) == 2 and one["policy_version"] == 1
    for call in one["calls"]:
        assert torch.equal(call["old"], call["logprobs"])
    # EOS / truncation masks reach the loss: 4 + 2 + 0 + 6 loss tokens.
    assert sum(int(c["mask"].sum()) for c in one["calls"]) == sum(VALID)

    # Two iterations: 2 × 2 calls; both iterations use the logprobs recorded before the first update.
    two = results["two"]
    first, second = two["calls"][:2], two["calls"][2:]
    assert len(two["calls"]) == 4 and two["policy_version"] == 1
    assert two["metrics"]["actor/update_skipped"] == 0.0
    for a, b in zip(first, second):
        assert torch.equal(a["old"], b["old"])
        assert masked_max_diff(a["logprobs"], a["old"], a["mask"]) < 1e-5  # before any update: ratio 1
        assert masked_max_diff(b["logprobs"], b["old"], b["mask"]) > 1e-4  # after one update: the policy moved
    assert two["metrics"]["actor/ratio_mean"] != 1.0
    # The first iteration equals the one-iteration run (same initial policy, same batch).
    for a, b in zip(first, one["calls"]):
        assert masked_max_diff(a["old"], b["old"], a["mask"]) < 1e-5
    assert abs(two["metrics"]["rollout/logprob_diff"] - one["metrics"]["rollout/logprob_diff"]) < 1e-5

    # Options: β set by the driver; KL moved into per-token advantages (loss kl_coef 0); TIS weights capped at
    # 1.5 (the engine logprobs ≈ −19.5 are far below the policy's ≈ −10.8, so every weight hits the cap); dual clip on.
    opt = results["options"]
    m = opt["metrics"]
    assert m["actor/kl_coef"] == 0.1 and opt["policy_version"] == 1
    assert "actor/dual_clip_fraction" in m and m["actor/tis_weight_mean"] == 1.5
    for call in opt["calls"]:
        assert call["kl_coef"] == 0.0 and call["dual_clip_c"] == 3.0
        assert call["advantages"].dim() == 2
        assert torch.equal(call["tis_weights"], torch.where(call["mask"], 1.5, 0.0))
    assert all(torch.isfinite(torch.tensor(v)) for k, v in m.items() if isinstance(v, float))

    # A NaN engine logprob with TIS on: that token's weight is 1 (the others hit the cap), the loss stays finite,
    # the update is applied, and rollout/logprob_diff averages the finite tokens only.
    nan = results["nan"]
    m = nan["metrics"]
    assert m["actor/update_skipped"] == 0.0 and nan["policy_version"] == 1
    assert all(torch.isfinite(torch.tensor(m[k])) for k in ("actor/loss", "actor/grad_norm", "rollout/logprob_diff",
                                                              "actor/tis_weight_mean"))
    expected = torch.where(nan["calls"][0]["mask"], 1.5, 0.0)
    expected[0, 1] = 1.0
    assert torch.equal(nan["calls"][0]["tis_weights"], expected)
