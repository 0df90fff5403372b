"""Weight sync and checkpoints of the Megatron worker (train_workers/megatron/sync.py, checkpoint.py) over gloo.

Sync parity: the engine-bound buckets of the Megatron worker at tp=2 (two ranks, each holding half of every split
tensor) and at pp=2 (two pipeline stages, each holding half of the layers; the embedding on the first, the final norm
and the tied embedding's copy on the last) equal those of the FSDP2 worker (two ranks, each holding half of every
tensor's rows) byte for byte — the same bucket plan (names, shapes, dtypes, offsets) and the same CRC-32 per tensor —
in float32 and bfloat16. All run the worker's real ``broadcast_weights`` (``weight_sync.sender.stream_buckets``) into
a sender that records the buckets (as tests/distributed/test_lora_worker.py does; the transports themselves are
tested in test_weight_sync_transports.py).

Checkpoints: after one train step at tp=2, ``save_checkpoint`` writes an HF folder that transformers loads with the
trained weights exactly, and ``init_distributed(policy_path=...)`` + ``load_checkpoint`` at tp=2, at tp=1 × dp=2 and
at pp=2 (other layouts: the files are in HF names) restore every parameter and AdamW moment bit-exactly, and the next
step from the checkpoint equals the step the original run took after saving (bit-exact at tp=2, 1e-6 at dp=2 and
pp=2). The pp=2 run then saves a checkpoint itself, whose HF folder and optimizer files hold every stage's tensors.
One spawn of two ranks runs all of it (~46 s on 2 shared cores before pp=2 was added, 2026-12-02).
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.test_fsdp_parity import MAX_RESPONSE_TOKENS, N, TEMPERATURE
from tests.distributed.test_lora_worker import RecordingSender
from tests.distributed.test_megatron_step import TWO_RANKS, _hf_tensors, make_batch, pack
from tests.megatron_cpu import make_tiny_hf_model
from weight_sync.group import free_ports

pytest.importorskip("megatron.core")

BUCKET_BYTES = 64 * 1024
DTYPES = ("float32", "bfloat16")


def _worker(rank: int, world: int, model_dir: str, port: int, strategy: str, tp: int = 1, policy_path=None,
            pp: int = 1):
    from cluster.spec import AlgorithmSpec, TrainSpec
    from train_workers.fsdp_worker import FSDPTrainWorker
    from train_workers.megatron.worker import MegatronTrainWorker

    train = TrainSpec(world_size=world, num_threads=1, lr=1e-3, timeout_s=120, strategy=strategy,
                      tensor_parallel_size=tp, pipeline_parallel_size=pp)
    cls = MegatronTrainWorker if strategy == "megatron" else FSDPTrainWorker
    worker = cls(rank, world, model_dir, train, AlgorithmSpec(kl_coef=0.0), TEMPERATURE, MAX_RESPONSE_TOKENS)
    worker.init_distributed("127.0.0.1", port, policy_path)
    return worker


def _sync(worker, rank: int) -> dict:
    """Rank 0's plan, checksums and raw bucket bytes for each engine dtype (the worker's own broadcast_weights)."""
    out = {}
    for dtype in DTYPES:
        plan = worker.sync_plan(dtype, BUCKET_BYTES)
        sender = RecordingSender() if rank == 0 else None
        worker.sender.group = sender  # what init_sync_group would set on rank 0, without engines
        report = worker.broadcast_weights(True)
        if rank == 0:
            out[dtype] = {"plan": [asdict(b) for b in plan], "checksums": report.checksums,
                          "bytes": {i: buf for i, buf in sender.sent.items()}}
    worker.sender.group = None
    return out


def _moments(worker) -> dict[str, torch.Tensor]:
    params = dict(worker.policy.model.named_parameters())
    out = {}
    for field in ("exp_avg", "exp_avg_sq"):
        moments = {n: worker.optimizer.state[p][field] for n, p in params.items()}
        out.update({f"{k}::{field}": v for k, v in _hf_tensors(worker, moments).items()})
    steps = {float(worker.optimizer.state[p]["step"]) for p in params.values()}
    return {**out, "steps": torch.tensor(sorted(steps))}


def _params(worker) -> dict[str, torch.Tensor]:
    return _hf_tensors(worker, dict(worker.policy.model.named_parameters()))


def _ranks_main(rank: int, world: int, model_dir: str, ckpt: str, ports: list[int], out_dir: str):
    from tests.megatron_cpu import install_cpu_shims

    torch.set_num_threads(1)
    install_cpu_shims()
    results = {}
    worker = _worker(rank, world, model_dir, ports[0], "fsdp")
    results["fsdp_sync"] = _sync(worker, rank)
    worker.shutdown()
    worker = _worker(rank, world, model_dir, ports[1], "megatron", tp=2)
    results["tp2_sync"] = _sync(worker, rank)
    _, responses, _ = make_batch()
    mbs, num_tokens = [pack(i) for i in TWO_RANKS[rank]], sum(len(r) for r in responses)
    worker.train_step(mbs, num_tokens, N)
    results["trained"], results["trained_moments"] = _params(worker), _moments(worker)
    worker.save_checkpoint(ckpt)
    worker.train_step(mbs, num_tokens, N)  # the step a resumed run must repeat
    results["continued"] = _params(worker)
    worker.shutdown()
    worker = _worker(rank, world, model_dir, ports[4], "megatron", pp=2)
    results["pp2_sync"] = _sync(worker, rank)
    worker.shutdown()
    for name, tp, pp, port in (("resumed_tp2", 2, 1, ports[2]), ("resumed_dp2", 1, 1, ports[3]),
                               ("resumed_pp2", 1, 2, ports[5])):
        worker = _worker(rank, world, model_dir, port, "megatron", tp=tp, policy_path=ckpt, pp=pp)
        changed = worker.load_checkpoint(ckpt, policy_version=1)
        results[name] = {"params": _params(worker), "moments": _moments(worker), "changed": changed,
                         "version": worker.policy_version}
        worker.train_step(mbs, num_tokens, N)
        results[name]["continued"] = _params(worker)
        if pp > 1:  # a checkpoint written from the pipeline layout
            worker.save_checkpoint(f"{ckpt}_pp2")
            results[name]["continued_moments"] = _moments(worker)
        worker.shutdown()
    if rank == 0:
        torch.save(results, f"{out_dir}/results.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_sync")
    model = make_tiny_hf_model(root / "model", "llama", tied=True, seed=0)
    ports = free_ports(6)
    mp.spawn(_ranks_main, args=(2, model, str(root / "ckpt"), ports, str(root)), nprocs=2, join=True)
    return torch.load(root / "results.pt"), root / "ckpt"


@pytest.mark.parametrize("layout", ["tp2_sync", "pp2_sync"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_megatron_sync_buckets_equal_fsdp_byte_for_byte(runs, dtype, layout):
    found, _ = runs
    fsdp, tp2 = found["fsdp_sync"][dtype], found[layout][dtype]
    assert tp2["plan"] == fsdp["plan"] and len(fsdp["plan"]) > 1
    assert tp2["checksums"] == fsdp["checksums"] and len(fsdp["checksums"]) == sum(len(b["slots"]) for b in
                                                                                   fsdp["plan"])
    assert fsdp["bytes"].keys() == tp2["bytes"].keys()
    assert all(torch.equal(tp2["bytes"][i], fsdp["bytes"][i]) for i in fsdp["bytes"])


def test_megatron_checkpoint_is_an_hf_folder_with_the_trained_weights(runs):
    from transformers import AutoModelForCausalLM

    found, ckpt = runs
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    state = dict(loaded.named_parameters())
    assert state.keys() == found["trained"].keys()
    assert all(torch.equal(state[n], found["trained"][n]) for n in state)
    assert (ckpt / "optimizer" / "param_groups.json").is_file()


@pytest.mark.parametrize("layout", ["resumed_tp2", "resumed_dp2", "resumed_pp2"])
def test_megatron_resume_restores_weights_and_adamw_state_exactly(runs, layout):
    found, _ = runs
    got = found[layout]
    assert got["version"] == 1 and got["changed"] == {}
    assert got["params"].keys() == found["trained"].keys()
    assert all(torch.equal(got["params"][n], found["trained"][n]) for n in got["params"])
    assert got["moments"].keys() == found["trained_moments"].keys()
    assert all(torch.equal(got["moments"][k], found["trained_moments"][k]) for k in got["moments"])
    assert float(found["trained_moments"]["steps"][0]) == 1.0
    # the next step from the checkpoint is the step the original run took (AdamW's second, bias-corrected step):
    # bit-exact in the same layout; at tp=1 × dp=2 and pp=2 the reductions run in another order (1e-6)
    atol = 0.0 if layout == "resumed_tp2" else 1e-6
    moved = max(float((found["continued"][n] - found["trained"][n]).abs().max()) for n in found["trained"])
    assert moved > 1e-5
    for name, want in found["continued"].items():
        torch.testing.assert_close(got["continued"][name], want, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def test_megatron_pp2_checkpoint_holds_the_pipeline_stages_weights_and_moments(runs):
    """A checkpoint written from the pp=2 layout (after its step): the HF folder and the optimizer files hold every
    stage's tensors in HF names, equal to the gathered parameters and AdamW moments bit for bit."""
    from transformers import AutoModelForCausalLM

    from train_workers.megatron.hf_io import SafetensorsFolder

    found, ckpt = runs
    got = found["resumed_pp2"]
    folder = ckpt.parent / f"{ckpt.name}_pp2"
    state = dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters())
    assert state.keys() == got["continued"].keys()
    assert all(torch.equal(state[n], got["continued"][n]) for n in state)
    optimizer = SafetensorsFolder(str(folder / "optimizer"))
    moments = {k: v for k, v in got["continued_moments"].items() if k != "steps"}
    assert {k for k in optimizer if not k.endswith("::step")} == moments.keys()
    assert all(torch.equal(optimizer[k], moments[k]) for k in moments)
    assert float(got["continued_moments"]["steps"][0]) == 2.0
