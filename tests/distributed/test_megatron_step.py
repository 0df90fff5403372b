"""One GRPO step of the Megatron worker (train_workers/megatron/worker.py) equals one of the FSDP2 worker.

Both backends run the real worker classes on the same packed micro-batches (``torch.multiprocessing.spawn`` ranks over
gloo): FSDP2 on one rank; Megatron at tp=1 (one rank), tp=2 (two ranks, one replica: the micro-batches of both ranks
are run by both), tp=2 with sequence parallelism (norm gradients summed over the TP group; without that sum the grad
norm differs from tp=2's by 1.1e-4 relative and the weights by 2e-4, measured), dp=2 (two ranks, tp=1: gradients
summed over the data-parallel group), pp=2 (two pipeline stages: megatron-core's 1F1B schedule, the loss on the last
stage, the tied embedding's two copies' gradients summed) and tp=2 × pp=2 (four ranks); and, with two iterations and
masked importance sampling (the no-grad behaviour pass before the first update, kept-token counts as the loss's
denominators), FSDP2 on one rank against Megatron at pp=2. The model is tests/megatron_cpu.py's random Llama with
SmolLM2's shape (tied embeddings, GQA, vocabulary 1100 padded to 1152/1280, so the padded columns must be dropped).
The policy starts from a second random model (``policy_path``), so the KL to the reference policy is far from 0 (≈
0.4); truncated importance sampling (``tis_cap``) against random engine logprobs makes the TIS weights and the logprob
diff nontrivial, and the gradient norm (≈ 1.3) is clipped to 1.

Compared (fp32): the step's loss, KL, entropy, clip fraction, TIS weight, logprob diff and grad norm within 1e-5
relative; the public ``reference_logprobs`` of one micro-batch within 1e-5; the clipped gradients the optimizer sees
and the parameters after the step, converted back to HF names (``sync.HFGatherer``), within rtol 1e-4 /
atol 1e-6·max|g| (gradients) and 1e-5 absolute (parameters; the step moves each by about lr = 1e-4;
tests/distributed/test_fsdp_parity.py explains why a larger lr does not make this stronger).
Measured (2026-12-02, CPU): relative differences ≤ 7.3e-7 on loss/KL/entropy/TIS/logprob diff and ≤ 2.0e-6 on the
grad norm in every layout (pp=2: ≤ 4.7e-7 and 1.7e-6; tp=2 × pp=2: ≤ 5.0e-7 and 1.8e-6); clip fraction and ratio
equal; the file takes ~95 s on 2 shared cores (the four-rank spawn included).

bf16 (``model.dtype: bfloat16``, both backends' mixed precision: float32 master weights, bf16 compute, float32
logprobs/loss): Megatron tp=1 and tp=2 against FSDP2 on the same batch within :data:`BF16_TOL` (bf16-sized, stated and
measured there), and the bf16 engine-bound sync buckets byte-identical before the step and within one bf16 rounding
after it.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.test_fsdp_parity import ADVANTAGES, MAX_RESPONSE_TOKENS, N, TEMPERATURE
from tests.megatron_cpu import VOCAB, make_tiny_hf_model
from train_workers.packing import empty_microbatch, pack_microbatch
from weight_sync.group import free_ports

pytest.importorskip("megatron.core")

METRICS = ("actor/loss", "actor/kl", "actor/entropy", "actor/clip_fraction", "actor/ratio_mean",
           "actor/tis_weight_mean", "rollout/logprob_diff", "actor/grad_norm")
#: rank → micro-batches (sequence indices) of each run's ranks.
ONE_RANK = [[[0, 1], [2, 3, 4, 5]]]
TWO_RANKS = [[[0, 1], [2]], [[3, 4, 5], []]]
FOUR_RANKS = [[[0, 1]], [[2]], [[3, 4]], [[5]]]
#: (FSDP2 run on one rank, Megatron run) pairs compared.
PAIRS = [("fsdp", "megatron_tp1"), ("fsdp", "megatron_tp2"), ("fsdp", "megatron_tp2_sp"), ("fsdp", "megatron_dp2"),
         ("fsdp", "megatron_pp2"), ("fsdp", "megatron_tp2pp2"), ("fsdp_it2", "megatron_pp2_it2")]
#: Two iterations with masked importance sampling: the no-grad behaviour pass before the first update, then kept-token
#: counts as the loss's denominators (through the pipeline: forward-only schedules, counts from the last stage).
IT2_MIS = {"num_iterations": 2, "mis": {"level": "token", "low": 0.05, "high": 20.0}}


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
    """Megatron-named local tensors (parameters or their gradients) → every full HF tensor, on every rank; a
    collective (TP group of the stage holding each, then the pipeline-parallel group)."""
    from train_workers.megatron.sync import hf_parameter_order, tensor_gatherer

    gather = tensor_gatherer(worker, named)
    return {name: gather(name).clone() for name, _ in sorted(hf_parameter_order(worker.ctx.model_path))}


def _snapshot(worker, backend: str, grads: bool) -> dict[str, torch.Tensor]:
    if backend == "fsdp":
        from train_workers.sharding import full_tensor

        return {n: full_tensor(p.grad if grads else p).detach().clone()
                for n, p in worker.policy.model.named_parameters()}
    named = dict(worker.policy.model.named_parameters())
    return _hf_tensors(worker, {n: (p.grad if grads else p) for n, p in named.items()})


def _bf16_buckets(worker, rank: int) -> dict | None:
    """Rank 0: the worker's bfloat16 engine-bound buckets (plan, CRC-32 per tensor, bytes) from its real
    ``broadcast_weights`` into a recording sender; a collective; other ranks return None."""
    from tests.distributed.test_lora_worker import RecordingSender

    plan = worker.sync_plan("bfloat16", 64 * 1024)
    sender = RecordingSender() if rank == 0 else None
    worker.sender.group = sender  # what init_sync_group would set on rank 0, without engines
    report = worker.broadcast_weights(True)
    worker.sender.group = None
    if rank != 0:
        return None
    return {"plan": [asdict(b) for b in plan], "checksums": report.checksums, "bytes": dict(sender.sent)}


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
    for run, port in zip(runs, ports):
        algorithm = AlgorithmSpec(**{"kl_coef": 0.04, "tis_cap": 2.0, "clip_eps_low": 0.2, "clip_eps_high": 0.2,
                                     **run.get("algorithm", {})})
        strategy = "megatron" if run["backend"] == "megatron" else "fsdp"
        train = TrainSpec(world_size=world, num_threads=1, lr=1e-4, max_grad_norm=1.0, timeout_s=120,
                          strategy=strategy, tensor_parallel_size=run.get("tp", 1),
                          pipeline_parallel_size=run.get("pp", 1),
                          sequence_parallel=run.get("sp", False),
                          num_gpus_per_worker=1.0 if gpu else 0.0)
        cls = MegatronTrainWorker if strategy == "megatron" else FSDPTrainWorker
        worker = cls(rank, world, dirs["reference"], train, algorithm, TEMPERATURE, MAX_RESPONSE_TOKENS, seed=0,
                     sampling_filters=run.get("filters"), dtype=run.get("dtype", "float32"))
        worker.init_distributed("127.0.0.1", port, policy_path=dirs["policy"])
        sync_before = _bf16_buckets(worker, rank) if run.get("sync") else None
        start = _snapshot(worker, run["backend"], grads=False) if run.get("sync") else None
        grads: dict = {}
        step = worker.optimizer.step

        def recording_step(*args, _step=step, _worker=worker, **kwargs):
            grads.update(_snapshot(_worker, run["backend"], grads=True))
            return _step(*args, **kwargs)

        worker.optimizer.step = recording_step
        reference = worker.reference_logprobs(pack([0, 1, 2]))  # the public call (through the pipeline at pp > 1)
        result = worker.train_step([pack(idx) for idx in run["microbatches"][rank]], num_tokens, N)
        params = _snapshot(worker, run["backend"], grads=False)
        sync = {"before": sync_before, "after": _bf16_buckets(worker, rank)} if run.get("sync") else None
        if rank == 0:
            torch.save({"result": asdict(result), "grads": grads, "params": params, "sync": sync, "start": start,
                        "reference": reference},
                       f"{out_dir}/{run['name']}.pt")
        worker.shutdown()


def _spawn(world: int, dirs: dict, runs: list[dict], out_dir) -> dict[str, dict]:
    ports = free_ports(len(runs))
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
                           {"name": "megatron_tp1", "backend": "megatron", "microbatches": ONE_RANK},
                           {"name": "fsdp_it2", "backend": "fsdp", "microbatches": ONE_RANK, "algorithm": IT2_MIS}],
                 root)
    out.update(_spawn(2, dirs, [{"name": "megatron_tp2", "backend": "megatron", "tp": 2, "microbatches": TWO_RANKS},
                                {"name": "megatron_tp2_sp", "backend": "megatron", "tp": 2, "sp": True,
                                 "microbatches": TWO_RANKS},
                                {"name": "megatron_dp2", "backend": "megatron", "microbatches": TWO_RANKS},
                                {"name": "megatron_pp2", "backend": "megatron", "pp": 2, "microbatches": TWO_RANKS},
                                {"name": "megatron_pp2_it2", "backend": "megatron", "pp": 2, "microbatches": TWO_RANKS,
                                 "algorithm": IT2_MIS}], root))
    out.update(_spawn(4, dirs, [{"name": "megatron_tp2pp2", "backend": "megatron", "tp": 2, "pp": 2,
                                 "microbatches": FOUR_RANKS}], root))
    diffs = {}
    for fsdp, run in PAIRS:
        ref, got = out[fsdp]["result"]["metrics"], out[run]["result"]["metrics"]
        diffs[run] = {k: f"{abs(got[k] - ref[k]) / max(abs(ref[k]), 1e-12):.1e}" for k in METRICS}
    print(diffs)  # relative differences, shown by pytest -rA / -s
    return out


@pytest.mark.parametrize("fsdp, run", PAIRS)
def test_megatron_step_metrics_match_fsdp(steps, fsdp, run):
    ref, got = steps[fsdp]["result"], steps[run]["result"]
    assert got["policy_version"] == ref["policy_version"] == 1 and not got["skipped"]
    m, r = got["metrics"], ref["metrics"]
    assert r["actor/kl"] > 1e-3 and r["actor/grad_norm"] > 1.0  # the policy differs from the reference; clipped
    keys = METRICS + (("actor/mis_masked_fraction",) if fsdp == "fsdp_it2" else ())
    for key in keys:
        assert abs(m[key] - r[key]) <= 1e-5 * max(1.0, abs(r[key])), (run, key, m[key], r[key])
    if fsdp == "fsdp_it2":  # MIS drops some tokens and keeps others
        assert 0.0 < r["actor/mis_masked_fraction"] < 1.0


@pytest.mark.parametrize("fsdp, run", PAIRS)
def test_megatron_reference_logprobs_match_fsdp(steps, fsdp, run):
    ref, got = steps[fsdp]["reference"], steps[run]["reference"]
    assert got.shape == ref.shape == (3, 8) and ref.abs().max() > 1.0
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fsdp, run", PAIRS)
def test_megatron_step_grads_and_weights_match_fsdp(steps, fsdp, run):
    ref, got = steps[fsdp], steps[run]
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


#: Megatron bf16 vs FSDP2 bf16 (both fp32 master weights, bf16 compute, fp32 logprobs/loss), same weights and batch:
#: two bf16 implementations (Megatron's unfused attention on a right-padded batch vs the packed attention; different
#: summation orders), so bf16-sized differences (8 significant bits, ≈ 0.4 % per rounding), as the FSDP2 bf16 vs fp32
#: tolerances of bench/gpu_check_train.py's MP_TOL. metric_rel: |Δ| ≤ tol · max(1, |FSDP2's|) for the loss, KL,
#: entropy, TIS weight and logprob diff; grad_norm_rel: relative; grad_cosine(_worst_tensor): cosine similarity of all
#: clipped gradients (of the worst parameter); update_sign_agreement: share of elements whose first AdamW update
#: (≈ −lr·sign(g)) has the same sign; update_kept: share of the elements the fp32 step moves that move (not 1: on CPU
#: ≈ 0.07 % of the bf16 weight-gradient elements, of both backends, come out exactly 0 — elements ~1000× below the
#: typical one — and AdamW leaves them); bucket_*: bf16 engine-bound buckets after the step (assert_close).
#: Measured at tp=1 (2026-12-02, CPU): metrics ≤ 9e-4, grad norm 5.4e-3 (FSDP2 bf16 vs fp32: 6.1e-3), cosine 0.99993
#: (worst tensor 0.9996), sign agreement 0.9957, update kept 0.9994 (FSDP2 bf16: 0.9993), buckets ≤ 1 bf16 ulp apart.
BF16_TOL = {"metric_rel": 5e-3, "clip_fraction_abs": 0.1, "grad_norm_rel": 2e-2, "grad_cosine": 0.999,
            "grad_cosine_worst_tensor": 0.995, "update_sign_agreement": 0.98, "update_kept": 0.99,
            "bucket_atol": 2.5e-4, "bucket_rtol": 2**-7}
BF16_METRICS = ("actor/loss", "actor/kl", "actor/entropy", "actor/tis_weight_mean", "rollout/logprob_diff")


@pytest.fixture(scope="module")
def bf16_steps(tmp_path_factory):
    """``model.dtype: bfloat16`` on both backends (FSDP2 one rank; Megatron tp=1 one rank, tp=2 two ranks), the
    bf16 engine-bound buckets before and after the step, and the float32 FSDP2 step (to show bf16 compute ran)."""
    root = tmp_path_factory.mktemp("megatron_bf16")
    dirs = _models(root)
    one = dict(microbatches=ONE_RANK, dtype="bfloat16", sync=True)
    out = _spawn(1, dirs, [{"name": "fsdp_fp32", "backend": "fsdp", "microbatches": ONE_RANK},
                           {"name": "fsdp_bf16", "backend": "fsdp", **one},
                           {"name": "megatron_bf16_tp1", "backend": "megatron", **one}], root)
    out.update(_spawn(2, dirs, [{"name": "megatron_bf16_tp2", "backend": "megatron", "tp": 2,
                                 **{**one, "microbatches": TWO_RANKS}}], root))
    ref = out["fsdp_bf16"]["result"]["metrics"]
    print({name: {k: f"{abs(r['result']['metrics'][k] - ref[k]) / max(abs(ref[k]), 1e-12):.1e}" for k in METRICS}
          for name, r in out.items()})  # relative differences to FSDP2 bf16, shown by pytest -rA / -s
    return out


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.mark.parametrize("run", ["megatron_bf16_tp1", "megatron_bf16_tp2"])
def test_megatron_bf16_step_matches_fsdp_bf16(bf16_steps, run):
    """Megatron's bf16 mixed precision (float32 parameters computed in bf16) against FSDP2's
    ``MixedPrecisionPolicy(bf16, fp32)`` on the same batch: metrics, gradients and the AdamW update within
    :data:`BF16_TOL`; the parameters stay float32 and the elements the float32 step moves move too (AdamW's first
    update, ≈ lr = 1e-4, lands on the float32 master weights); and the step did run in bf16 (it differs from the
    fp32 one by far more than the fp32 parity tolerance, 1e-5)."""
    got, ref, fp32 = bf16_steps[run], bf16_steps["fsdp_bf16"], bf16_steps["fsdp_fp32"]
    m, r, r32 = got["result"]["metrics"], ref["result"]["metrics"], fp32["result"]["metrics"]
    assert got["result"]["policy_version"] == 1 and not got["result"]["skipped"]
    diffs = {key: abs(m[key] - r[key]) / max(1.0, abs(r[key])) for key in BF16_METRICS}
    print(run, {k: f"{v:.1e}" for k, v in diffs.items()})
    assert max(diffs.values()) <= BF16_TOL["metric_rel"], diffs
    assert abs(m["actor/clip_fraction"] - r["actor/clip_fraction"]) <= BF16_TOL["clip_fraction_abs"]
    assert abs(m["actor/grad_norm"] - r["actor/grad_norm"]) <= BF16_TOL["grad_norm_rel"] * r["actor/grad_norm"]
    assert max(abs(m[k] - r32[k]) / max(1.0, abs(r32[k])) for k in BF16_METRICS) > 1e-4  # not an fp32 step
    names = sorted(ref["grads"])
    g, g_ref = (torch.cat([d[n].flatten() for n in names]) for d in (got["grads"], ref["grads"]))
    assert _cosine(g, g_ref) >= BF16_TOL["grad_cosine"]
    assert min(_cosine(got["grads"][n], ref["grads"][n]) for n in names) >= BF16_TOL["grad_cosine_worst_tensor"]
    assert {p.dtype for p in got["params"].values()} == {torch.float32}
    start = ref["start"]
    d_got = torch.cat([(got["params"][n] - start[n]).flatten() for n in names])
    d_ref = torch.cat([(ref["params"][n] - start[n]).flatten() for n in names])
    moved32 = torch.cat([(fp32["params"][n] - start[n]).flatten() for n in names]) != 0
    assert float((d_got != 0)[moved32].double().mean()) >= BF16_TOL["update_kept"]
    assert float((torch.sign(d_got) == torch.sign(d_ref)).double().mean()) >= BF16_TOL["update_sign_agreement"]


@pytest.mark.parametrize("run", ["megatron_bf16_tp1", "megatron_bf16_tp2"])
def test_megatron_bf16_sync_buckets_match_fsdp_bf16(bf16_steps, run):
    """The bf16 engine-bound buckets (the worker's real ``broadcast_weights``, engine dtype bfloat16) from the
    bf16-trained Megatron worker: before the step byte-identical to FSDP2's (same plan, same CRC-32 per tensor: both
    cast the same float32 master weights); after it the same plan and values within one bf16 rounding of FSDP2's
    (the float32 weights differ by the bf16-compute differences above)."""
    got, ref = bf16_steps[run]["sync"], bf16_steps["fsdp_bf16"]["sync"]
    assert got["before"]["plan"] == ref["before"]["plan"] == got["after"]["plan"]
    assert got["before"]["checksums"] == ref["before"]["checksums"]
    assert all(torch.equal(got["before"]["bytes"][i], b) for i, b in ref["before"]["bytes"].items())
    for i, buf in ref["after"]["bytes"].items():
        torch.testing.assert_close(got["after"]["bytes"][i].view(torch.bfloat16).float(),
                                   buf.view(torch.bfloat16).float(), atol=BF16_TOL["bucket_atol"],
                                   rtol=BF16_TOL["bucket_rtol"], msg=lambda msg: f"{run}: bucket {i}: {msg}")
    assert got["after"]["checksums"] != got["before"]["checksums"]  # the step moved the weights the engines get
