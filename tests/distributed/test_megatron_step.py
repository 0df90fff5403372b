"""One GRPO step of the Megatron worker (train_workers/megatron/worker.py) equals one of the FSDP2 worker.

Both backends run the real worker classes on the same packed micro-batches (``torch.multiprocessing.spawn`` ranks over
gloo): FSDP2 on one rank; Megatron at tp=1 (one rank), tp=2 (two ranks, one replica: the micro-batches of both ranks
are run by both), tp=2 with sequence parallelism (norm gradients summed over the TP group; without that sum the grad
norm differs from tp=2's by 1.1e-4 relative and the weights by 2e-4, measured) and dp=2 (two ranks, tp=1: gradients
summed over the data-parallel group). The model is tests/megatron_cpu.py's random Llama with SmolLM2's shape (tied
embeddings, GQA, vocabulary 1100 padded to 1152/1280, so the padded columns must be dropped). The policy starts from a
second random model (``policy_path``), so the KL to the reference policy is far from 0 (≈ 0.4); truncated importance
sampling (``tis_cap``) against random engine logprobs makes the TIS weights and the logprob diff nontrivial, and the
gradient norm (≈ 1.3) is clipped to 1.

Compared (fp32): the step's loss, KL, entropy, clip fraction, TIS weight, logprob diff and grad norm within 1e-5
relative; the clipped gradients the optimizer sees and the parameters after the step, converted back to HF names
(``sync.HFGatherer``), within rtol 1e-4 / atol 1e-6·max|g| (gradients) and 1e-5 absolute (parameters; the step moves
each by about lr = 1e-4; tests/distributed/test_fsdp_parity.py explains why a larger lr does not make this stronger).
Measured (2026-12-02, CPU): relative differences ≤ 6e-7 on loss/KL/entropy/TIS/logprob diff and ≤ 1.8e-6 on the
grad norm at tp=1, tp=2, tp=2 with sequence parallelism and dp=2; clip fraction and ratio equal; the file takes
~75 s on 2 shared cores (tests/distributed -k megatron: 52 s with the machine otherwise idle).
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.test_fsdp_parity import ADVANTAGES, MAX_RESPONSE_TOKENS, N, TEMPERATURE
from tests.megatron_cpu import VOCAB, make_tiny_hf_model
from train_workers.packing import empty_microbatch, pack_microbatch
from weight_sync.group import free_port

pytest.importorskip("megatron.core")

METRICS = ("actor/loss", "actor/kl", "actor/entropy", "actor/clip_fraction", "actor/ratio_mean",
           "actor/tis_weight_mean", "rollout/logprob_diff", "actor/grad_norm")
#: rank → micro-batches (sequence indices) of each run's ranks.
ONE_RANK = [[[0, 1], [2, 3, 4, 5]]]
TWO_RANKS = [[[0, 1], [2]], [[3, 4, 5], []]]
RUNS = ["megatron_tp1", "megatron_tp2", "megatron_tp2_sp", "megatron_dp2"]


def make_batch():
    g = torch.Generator().manual_seed(99)
    prompt_lens, response_lens = [5, 3, 8, 4, 6, 2], [4, 8, 2, 6, 3, 5]
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in response_lens]
    behaviour = [-3.0 - 4.0 * torch.rand(n, generator=g) for n in response_lens]  # near the policy's ~log(1/1100)
    return prompts, responses, behaviour


def pack(indices):
    prompts, responses, behaviour = make_batch()
    if not indices:
        return empty_microbatch()
    return pack_microbatch([prompts[i] for i in indices], [responses[i] for i in indices],
                           [ADVANTAGES[i] for i in indices], [behaviour[i] for i in indices], indices)


def _hf_tensors(worker, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron-named local tensors (parameters or their gradients) → full HF tensors; a collective (TP group)."""
    from train_workers.megatron.sync import HFGatherer

    params = dict(worker.policy.model.named_parameters())
    split = {n: bool(getattr(p, "tensor_model_parallel", False)) for n, p in params.items()}
    gather = HFGatherer(named, split, worker.layout, worker.pp_rank, worker.tp_group)
    return {name: gather(name).clone() for name in sorted(gather.source)}


def _snapshot(worker, backend: str, grads: bool) -> dict[str, torch.Tensor]:
    if backend == "fsdp":
        from train_workers.sharding import full_tensor

        return {n: full_tensor(p.grad if grads else p).detach().clone()
                for n, p in worker.policy.model.named_parameters()}
    named = dict(worker.policy.model.named_parameters())
    return _hf_tensors(worker, {n: (p.grad if grads else p) for n, p in named.items()})


def _ranks_main(rank: int, world: int, dirs: dict, runs: list[dict], ports: list[int], out_dir: str):
    from cluster.spec import AlgorithmSpec, TrainSpec
    from tests.megatron_cpu import install_cpu_shims
    from train_workers.fsdp_worker import FSDPTrainWorker
    from train_workers.megatron.worker import MegatronTrainWorker

    torch.set_num_threads(1)
    gpu = any(run.get("gpu") for run in runs)  # tests/gpu: CUDA + NCCL, megatron-core unpatched
    if not gpu:
        install_cpu_shims()
    _, responses, _ = make_batch()
    num_tokens = sum(len(r) for r in responses)
    algorithm = AlgorithmSpec(kl_coef=0.04, tis_cap=2.0, clip_eps_low=0.2, clip_eps_high=0.2)
    for run, port in zip(runs, ports):
        strategy = "megatron" if run["backend"] == "megatron" else "fsdp"
        train = TrainSpec(world_size=world, num_threads=1, lr=1e-4, max_grad_norm=1.0, timeout_s=120,
                          strategy=strategy, tensor_parallel_size=run.get("tp", 1),
                          sequence_parallel=run.get("sp", False),
                          num_gpus_per_worker=1.0 if gpu else 0.0)
        cls = MegatronTrainWorker if strategy == "megatron" else FSDPTrainWorker
        worker = cls(rank, world, dirs["reference"], train, algorithm, TEMPERATURE, MAX_RESPONSE_TOKENS, seed=0,
                     sampling_filters=run.get("filters"))
        worker.init_distributed("127.0.0.1", port, policy_path=dirs["policy"])
        grads: dict = {}
        step = worker.optimizer.step

        def recording_step(*args, _step=step, _worker=worker, **kwargs):
            grads.update(_snapshot(_worker, run["backend"], grads=True))
            return _step(*args, **kwargs)

        worker.optimizer.step = recording_step
        result = worker.train_step([pack(idx) for idx in run["microbatches"][rank]], num_tokens, N)
        params = _snapshot(worker, run["backend"], grads=False)
        if rank == 0:
            torch.save({"result": asdict(result), "grads": grads, "params": params}, f"{out_dir}/{run['name']}.pt")
        worker.shutdown()


def _spawn(world: int, dirs: dict, runs: list[dict], out_dir) -> dict[str, dict]:
    ports = [free_port() for _ in runs]
    mp.spawn(_ranks_main, args=(world, dirs, runs, ports, str(out_dir)), nprocs=world, join=True)
    return {run["name"]: torch.load(out_dir / f"{run['name']}.pt") for run in runs}


def _models(root) -> dict[str, str]:
    return {"reference": make_tiny_hf_model(root / "reference", "llama", tied=True, seed=0),
            "policy": make_tiny_hf_model(root / "policy", "llama", tied=True, seed=1)}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_step")
    dirs = _models(root)
    out = _spawn(1, dirs, [{"name": "fsdp", "backend": "fsdp", "microbatches": ONE_RANK},
                           {"name": "megatron_tp1", "backend": "megatron", "microbatches": ONE_RANK}], root)
    out.update(_spawn(2, dirs, [{"name": "megatron_tp2", "backend": "megatron", "tp": 2, "microbatches": TWO_RANKS},
                                {"name": "megatron_tp2_sp", "backend": "megatron", "tp": 2, "sp": True,
                                 "microbatches": TWO_RANKS},
                                {"name": "megatron_dp2", "backend": "megatron", "microbatches": TWO_RANKS}], root))
    ref = out["fsdp"]["result"]["metrics"]
    print({name: {k: f"{abs(r['result']['metrics'][k] - ref[k]) / max(abs(ref[k]), 1e-12):.1e}" for k in METRICS}
           for name, r in out.items()})  # relative differences, shown by pytest -rA / -s
    return out


@pytest.mark.parametrize("run", RUNS)
def test_megatron_step_metrics_match_fsdp(steps, run):
    ref, got = steps["fsdp"]["result"], steps[run]["result"]
    assert got["policy_version"] == ref["policy_version"] == 1 and not got["skipped"]
    m, r = got["metrics"], ref["metrics"]
    assert r["actor/kl"] > 1e-3 and r["actor/grad_norm"] > 1.0  # the policy differs from the reference; clipped
    for key in METRICS:
        assert abs(m[key] - r[key]) <= 1e-5 * max(1.0, abs(r[key])), (run, key, m[key], r[key])


@pytest.mark.parametrize("run", RUNS)
def test_megatron_step_grads_and_weights_match_fsdp(steps, run):
    ref, got = steps["fsdp"], steps[run]
    assert got["params"].keys() == ref["params"].keys() == got["grads"].keys()
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    for name in ref["params"]:
        torch.testing.assert_close(got["grads"][name], ref["grads"][name], rtol=1e-4, atol=1e-6 * scale,
                                   msg=lambda m: f"{run}: grad of {name}: {m}")
        torch.testing.assert_close(got["params"][name], ref["params"][name], rtol=0, atol=1e-5,
                                   msg=lambda m: f"{run}: {name}: {m}")


FILTERS = {"top_k": 50, "top_p": 0.9, "min_p": 0.0}


def test_megatron_tp1_sampling_filters_match_fsdp(tmp_path):
    """With the rollout's top-k/top-p (tp = 1: ``grpo.logprobs`` on the gathered logits), the step still equals
    FSDP2's (whose fused head applies the same filters). The filters matter: the entropy of the filtered
    distribution is ≈ 3.8 nats against ≈ 6.9 unfiltered (log 1100 ≈ 7.0)."""
    dirs = _models(tmp_path)
    out = _spawn(1, dirs, [{"name": "fsdp_f", "backend": "fsdp", "microbatches": ONE_RANK, "filters": FILTERS},
                           {"name": "megatron_f", "backend": "megatron", "microbatches": ONE_RANK,
                            "filters": FILTERS}], tmp_path)
    ref, got = out["fsdp_f"]["result"]["metrics"], out["megatron_f"]["result"]["metrics"]
    assert got["actor/entropy"] < 5.0
    for key in METRICS:
        assert abs(got[key] - ref[key]) <= 1e-5 * max(1.0, abs(ref[key])), (key, got[key], ref[key])
    scale = max(float(g.abs().max()) for g in out["fsdp_f"]["grads"].values())
    for name, g in out["fsdp_f"]["grads"].items():
        torch.testing.assert_close(out["megatron_f"]["grads"][name], g, rtol=1e-4, atol=1e-6 * scale)
