"""The FSDP2 train worker with LoRA adapters (``train.lora``, issue 16), two gloo ranks, the tiny random Llama.

One spawn runs the real ``FSDPTrainWorker`` (the class the Ray pool wraps) through a job's life: build (PEFT before
FSDP2), two train steps with ``kl_coef`` > 0 (so every micro-batch runs the reference pass, adapters off, before the
policy's own forward), the merged weight-sync stream through the real sender (``weight_sync.sender.stream_buckets``)
with checksums, a checkpoint, a third step; then a second worker resumes from the checkpoint and takes the same third
step. Rank 0 records what it saw; the assertions run here, against the base model and PEFT's own merge computed in
this process:

* step-0 policy logprobs equal the base model's (B = 0), and the reference logprobs equal the frozen base's before and
  after training; no reference copy is loaded;
* after the steps only adapter tensors changed (every one of them), the base is bit-identical;
* the merged buckets hold PEFT's ``merge_and_unload`` weights under the HF names (no ``base_layer``/``lora_`` name),
  with matching CRC-32s, and the merged HF folder (``grpo-cluster merge``) gives the trainer's logprobs;
* resume restores the adapters and AdamW's moments exactly, and the resumed third step equals the uninterrupted one;
* the resumed worker runs with ``sync: adapter``: its stream holds exactly the checkpoint's PEFT adapter file (names,
  values, CRC-32s) and its adapter config is the checkpoint's ``adapter_config.json``, at a small fraction of the
  merged stream's bytes.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from tests.distributed.test_fsdp_parity import MAX_RESPONSE_TOKENS, TEMPERATURE, N, make_batch, pack
from weight_sync.group import free_ports

LORA = {"rank": 4, "alpha": 8.0}
LR = 1e-3
#: Per rank: two micro-batches (rank 1's second is the placeholder that keeps the counts equal).
MICROBATCHES = [[[0, 1], [2]], [[3, 4, 5], []]]


class RecordingSender:
    """A transport sender (``weight_sync.transport``'s interface) that keeps a copy of every bucket it is sent."""

    buffer_bytes = 0

    def __init__(self):
        self.sent: dict[int, torch.Tensor] = {}

    def begin(self, buckets) -> None:
        self.buffer_bytes = max(b.nbytes for b in buckets)

    def buffer(self, bucket) -> torch.Tensor:
        return torch.empty(bucket.nbytes, dtype=torch.uint8)

    def send(self, bucket, buf: torch.Tensor) -> None:
        self.sent[bucket.index] = buf.clone()

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _full(named) -> dict[str, torch.Tensor]:
    from train_workers.sharding import full_tensor

    return {name: full_tensor(p.detach()).clone() for name, p in named}


def _moments(worker) -> dict[str, torch.Tensor]:
    from train_workers.sharding import full_tensor

    names = {id(p): n for n, p in worker.policy.named_parameters()}
    return {f"{names[id(p)]}::{k}": (full_tensor(v) if v.dim() else v).detach().clone()
            for p, state in worker.optimizer.state.items() for k, v in state.items()}


def _worker(rank: int, world: int, model_dir: str, port: int, policy_path: str | None = None, sync: str = "merged"):
    from cluster.spec import AlgorithmSpec, LoraSpec, TrainSpec
    from train_workers.fsdp_worker import FSDPTrainWorker

    train = TrainSpec(world_size=world, num_threads=1, lr=LR, timeout_s=120, lora=LoraSpec(**LORA, sync=sync))
    worker = FSDPTrainWorker(rank, world, model_dir, train, AlgorithmSpec(kl_coef=0.04), TEMPERATURE,
                             MAX_RESPONSE_TOKENS, dtype="float32", seed=0)
    worker.init_distributed("127.0.0.1", port, policy_path)
    return worker


def _policy_logprobs(worker, mb) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = worker.policy(*worker.engine.inputs(mb), with_entropy=False)
    out = mb.to_padded(lp.float()).clone()
    worker.reference_logprobs(mb)  # leaves the policy sharded again (a public call)
    return out


def _stream(worker, rank: int) -> tuple[dict, dict, int]:
    """Stream ``worker``'s sync plan through the real sender (every rank gathers): rank 0's ({name: tensor},
    {name: CRC-32}, total bucket bytes); empty dicts on other ranks."""
    from weight_sync.buckets import unpack_bucket
    from weight_sync.sender import stream_buckets

    plan = worker.sync_plan("float32", 64 * 1024)
    sender = RecordingSender() if rank == 0 else None
    gather = {name: fn for name, _, fn in worker.sender.sources()}
    report = stream_buckets(plan, lambda name: gather[name](), sender, [s.name for b in plan for s in b.slots])
    if sender is None:
        return {}, {}, 0
    tensors = {name: t.clone() for b in plan for name, t in unpack_bucket(b, sender.sent[b.index])}
    return tensors, report["checksums"], sum(b.nbytes for b in plan)


def _ranks_main(rank: int, world: int, model_dir: str, ports: list[int], out_dir: str):
    torch.set_num_threads(1)
    num_tokens = sum(len(r) for r in make_batch()[1])
    probe = pack(list(range(N)))

    def step(w):
        return w.train_step([pack(idx) for idx in MICROBATCHES[rank]], num_tokens, N)

    rec: dict = {}
    w = _worker(rank, world, model_dir, ports[0])
    rec["reference_loaded"] = w.reference is not None
    rec["step0_policy"] = _policy_logprobs(w, probe)
    rec["ref0"] = w.reference_logprobs(probe)
    rec["params0"] = _full(w.policy.model.named_parameters())
    rec["metrics"] = [step(w).metrics, step(w).metrics]
    rec["params2"] = _full(w.policy.model.named_parameters())
    rec["policy2"] = _policy_logprobs(w, probe)
    rec["ref2"] = w.reference_logprobs(probe)
    rec["buckets"], rec["checksums"], rec["merged_bytes"] = _stream(w, rank)
    ckpt = f"{out_dir}/ckpt"
    w.save_checkpoint(ckpt)
    rec["moments2"] = _moments(w)
    step(w)
    rec["params3"] = _full(w.policy.model.named_parameters())
    w.shutdown()

    r = _worker(rank, world, model_dir, ports[1], policy_path=ckpt, sync="adapter")
    rec["changed"] = r.load_checkpoint(ckpt, 2)
    rec["adapter_buckets"], rec["adapter_checksums"], rec["adapter_bytes"] = _stream(r, rank)
    rec["adapter_config"] = r.sync_adapter_config()
    rec["resumed_params"] = _full(r.policy.model.named_parameters())
    rec["resumed_moments"] = _moments(r)
    rec["resumed_version"] = step(r).policy_version
    rec["resumed_params3"] = _full(r.policy.model.named_parameters())
    r.shutdown()
    if rank == 0:
        torch.save(rec, f"{out_dir}/rank0.pt")


def _base_logprobs(model_dir: str, mb) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from train_workers.policy import ResponseLogprobModel

    model = ResponseLogprobModel(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), TEMPERATURE)
    with torch.no_grad():
        lp, _ = model(mb.input_ids, mb.position_ids, mb.logit_positions, mb.targets, with_entropy=False)
    return mb.to_padded(lp.float())


def test_lora_worker_trains_adapters_only_syncs_merged_weights_and_resumes_exactly(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from train_workers.lora import is_adapter
    from train_workers.lora_checkpoint import merge_lora_checkpoint
    from train_workers.policy import ResponseLogprobModel
    from weight_sync.buckets import tensor_checksum

    mp.spawn(_ranks_main, args=(2, tiny_model_dir, free_ports(2), str(tmp_path)), nprocs=2, join=True)
    rec = torch.load(tmp_path / "rank0.pt")
    probe = pack(list(range(N)))
    base = _base_logprobs(tiny_model_dir, probe)

    # Step 0: the policy is the base (B = 0); the reference is the base, before and after training; no copy loaded.
    # Tolerance: a few float32 ulps at |logprob| ≈ 11 (ulp 9.5e-7): the sharded 1-thread forward and this process's
    # forward sum in different orders (measured once: 1.9e-6 on 1 of 48 tokens).
    assert not rec["reference_loaded"]
    torch.testing.assert_close(rec["step0_policy"], base, rtol=0, atol=4e-6)
    torch.testing.assert_close(rec["ref0"], base, rtol=0, atol=4e-6)
    torch.testing.assert_close(rec["ref2"], base, rtol=0, atol=4e-6)
    assert float((rec["policy2"] - base).abs().max()) > 1e-4  # the adapters did change the policy

    # Only the adapters moved, all of them (A too: after the first step B != 0 gives A a gradient).
    before, after = rec["params0"], rec["params2"]
    adapters = [n for n in before if is_adapter(n)]
    assert len(adapters) == 2 * 7 * 2  # 2 layers x 7 linear layers x (A, B)
    for name in before:
        if is_adapter(name):
            assert not torch.equal(before[name], after[name]), f"adapter {name} did not change"
        else:
            assert torch.equal(before[name], after[name]), f"frozen {name} changed"
    m = rec["metrics"][1]
    assert m["actor/trainable_parameters"] == sum(before[n].numel() for n in adapters)
    assert 0 < m["actor/trainable_fraction"] < 0.01
    assert m["actor/kl"] > 0 and rec["metrics"][0]["actor/kl"] == 0.0  # reference = policy only at step 0
    assert {"memory/train_rank0_peak_rss_gib", "memory/train_rank1_peak_rss_gib"} <= m.keys()
    assert m["memory/train_rank1_peak_rss_gib"] > 0 and m["memory/train_optimizer_state_gib"] > 0

    # Merged sync: PEFT's own merge of the checkpoint's adapters (saved right after the stream), same names.
    ckpt = str(tmp_path / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    merged = dict(PeftModel.from_pretrained(hf, ckpt).merge_and_unload().named_parameters())
    buckets = rec["buckets"]
    assert list(buckets) == list(merged)
    assert not any("base_layer" in n or "lora_" in n for n in buckets)
    for name, tensor in buckets.items():
        torch.testing.assert_close(tensor, merged[name].detach(), rtol=1e-6, atol=1e-7, msg=name)
        assert rec["checksums"][name] == tensor_checksum(tensor)
    assert not torch.equal(buckets["model.layers.0.self_attn.q_proj.weight"],
                           before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])

    # grpo-cluster merge: a transformers-loadable folder with the trainer's logprobs.
    out = merge_lora_checkpoint(ckpt, str(tmp_path / "merged"))
    folder = ResponseLogprobModel(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), TEMPERATURE)
    with torch.no_grad():
        lp, _ = folder(probe.input_ids, probe.position_ids, probe.logit_positions, probe.targets, with_entropy=False)
    torch.testing.assert_close(probe.to_padded(lp.float()), rec["policy2"], rtol=0, atol=1e-5)

    # Resume: adapters and AdamW moments exactly as saved; the next step equals the uninterrupted run's.
    assert rec["changed"] == {}
    assert rec["resumed_params"].keys() == after.keys()
    for name in after:
        assert torch.equal(rec["resumed_params"][name], after[name]), name
    assert rec["resumed_moments"].keys() == rec["moments2"].keys() and len(rec["moments2"]) == 3 * len(adapters)
    for key, value in rec["moments2"].items():
        assert torch.equal(rec["resumed_moments"][key], value), key
    assert rec["resumed_version"] == 3
    for name, value in rec["params3"].items():
        torch.testing.assert_close(rec["resumed_params3"][name], value, rtol=0, atol=1e-7, msg=name)

    # Adapter sync (the resumed worker): exactly the checkpoint's PEFT adapter file and config, far fewer bytes.
    import json

    from safetensors.torch import load_file

    saved = load_file(f"{ckpt}/adapter_model.safetensors")
    assert sorted(rec["adapter_buckets"]) == sorted(saved) and len(saved) == len(adapters)
    for name, tensor in rec["adapter_buckets"].items():
        assert torch.equal(tensor, saved[name]), name
        assert rec["adapter_checksums"][name] == tensor_checksum(tensor)
    written = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert rec["adapter_config"] == {**written, "target_modules": sorted(written["target_modules"])}
    assert rec["adapter_bytes"] < rec["merged_bytes"] / 100
