"""The in-process weight sync: the train rank's real sender (``sync_plan``, ``init_sync_group``,
``broadcast_weights``) to a ``weight_sync`` receiver in this process, two gloo groups in one process, verified by
checksums; full fine-tuning, LoRA ``merged`` and LoRA ``adapter``.

Each case: the fleet samples on policy version 0 and the rank trains on it (its ``rollout/logprob_diff`` vs the fleet
< 2e-5); the fleet, not synced, samples again and the rank's next step sees a gap (its weights moved: > 1e-4); after
a sync the fleet's tensors equal the rank's (bit for bit; LoRA merged: W + s·B·A within float32 rounding), every
tensor's checksum was verified, and the gap is back below 2e-5 (measured: ≈ 2e-7 in sync, ≈ 5e-2 one version
behind). Also: which tensors ``sync.verify`` checks, and the two gloo groups in one process the sync rests on.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from contract.sync_reports import SyncReport
from tests.local_runtime import PROMPTS, local_spec, requests_for, running, train_on
from train_workers.lora import ADAPTER, hf_name, is_adapter
from train_workers.sharding import full_tensor

CASES = {
    "full": {},
    "lora_merged": {"lr": 1e-2, "lora": {"rank": 4, "alpha": 8.0, "sync": "merged"}},
    "lora_adapter": {"lr": 1e-2, "lora": {"rank": 4, "alpha": 8.0, "sync": "adapter"}},
}


def _trainer_tensors(trainer) -> dict[str, torch.Tensor]:
    """The rank's policy parameters, whole, by their module names (PEFT's names under LoRA)."""
    return {name: full_tensor(p.detach()).clone() for name, p in trainer.worker.policy.model.named_parameters()}


def _check_fleet_holds_the_policy(case: str, trainer, fleet) -> None:
    policy = _trainer_tensors(trainer)
    fleet_tensors = dict(fleet.model.named_parameters())
    if case == "full":
        assert policy.keys() == fleet_tensors.keys()
        for name, t in policy.items():
            assert torch.equal(fleet_tensors[name], t), name
            assert fleet_tensors[name].data_ptr() != t.data_ptr()
    elif case == "lora_adapter":  # the fleet's PEFT model: the same names; only the adapters are streamed
        changed = [n for n in policy if is_adapter(n) and n.endswith(f"lora_B.{ADAPTER}.weight")]
        assert changed and all(torch.equal(fleet_tensors[n], policy[n]) for n in policy if is_adapter(n))
        assert all(float(policy[n].abs().max()) > 0 for n in changed)  # B moved away from 0
    else:  # merged: W + s·B·A under the HF names, untargeted tensors as they are
        merged = 0
        for name, t in policy.items():
            if is_adapter(name):
                continue
            if name.endswith(".base_layer.weight"):
                layer = trainer.worker.policy.model.get_submodule(name.removesuffix(".base_layer.weight"))
                prefix = name.removesuffix("base_layer.weight")
                a, b = policy[f"{prefix}lora_A.{ADAPTER}.weight"], policy[f"{prefix}lora_B.{ADAPTER}.weight"]
                t = t + (b @ a) * layer.scaling[ADAPTER]
                merged += 1
            torch.testing.assert_close(fleet_tensors[hf_name(name)], t, rtol=0, atol=1e-6)
        assert merged > 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_streams_the_trained_policy_into_the_fleet(case, tiny_model_dir, tmp_path):
    spec = local_spec(tiny_model_dir, str(tmp_path), rollout={"max_staleness": 1}, train=CASES[case])
    with running(spec, tiny_model_dir) as (trainer, fleet, versions):
        tok = fleet.tokenizer
        first = train_on(trainer, versions, fleet.generate(requests_for(tok, PROMPTS[:2])))
        assert first.metrics["rollout/logprob_diff"] < 2e-5
        stale = fleet.generate(requests_for(tok, PROMPTS[:2], seed=7))  # 1 version behind: within max_staleness
        assert all(g.policy_version == 0 for g in stale)
        gap = train_on(trainer, versions, stale).metrics["rollout/logprob_diff"]
        assert gap > 1e-4, gap  # the rank moved on: the fleet, not synced yet, differs

        report = fleet.sync_policy()
        names = fleet.sync_names
        assert isinstance(report, SyncReport)
        assert (report.policy_version, report.verified, report.verified_tensors) == (2, True, len(names))
        assert report.engines == 1 and report.bytes > 0 and not report.ipc
        assert versions.engine_versions == [2] and versions.stale_engines() == []
        assert fleet.model_version == 2
        _check_fleet_holds_the_policy(case, trainer, fleet)
        if case == "lora_adapter":
            assert all(".lora_" in name for name in names)

        after = fleet.generate(requests_for(tok, PROMPTS[:2], seed=9))
        assert all(g.policy_version == 2 for g in after)
        assert train_on(trainer, versions, after).metrics["rollout/logprob_diff"] < 2e-5


@pytest.mark.parametrize("verify", ["sample", False])
def test_which_tensors_a_sync_verifies(verify, tiny_model_dir, tmp_path):
    """``sync.verify: sample`` with ``verify_full_every`` K = 2: policy version 1 checks the tensors of odd plan
    index, version 2 every tensor (``weight_sync.verify.checked_names``); ``false``: none, the weights still
    arrive."""
    sync = {"verify": verify, "verify_full_every": 2} if verify == "sample" else {"verify": verify}
    spec = local_spec(tiny_model_dir, str(tmp_path), sync=sync)
    with running(spec, tiny_model_dir) as (trainer, fleet, versions):
        names = fleet.sync_names
        reports = []
        for step in range(2):
            train_on(trainer, versions, fleet.generate(requests_for(fleet.tokenizer, PROMPTS[:1], seed=step)))
            reports.append(fleet.sync_policy())
        checked = [(r.policy_version, r.verified_tensors, r.verified) for r in reports]
        if verify == "sample":
            assert checked == [(1, len(names[1::2]), True), (2, len(names), True)]
        else:
            assert checked == [(1, 0, False), (2, 0, False)]
        after = fleet.generate(requests_for(fleet.tokenizer, PROMPTS[:1], seed=5))
        assert train_on(trainer, versions, after).metrics["rollout/logprob_diff"] < 2e-5


def test_two_gloo_groups_in_one_process():
    """What the in-process sync rests on: a default gloo group and a two-member ``SyncGroup`` in one process, the
    sender's side in a worker thread (which also runs collectives of the default group, as the rank's gathers do)
    and the receiver's in this thread; broadcasts arrive intact, and the process can form a default group again."""
    from concurrent.futures import ThreadPoolExecutor

    from weight_sync.group import SyncGroup, free_port

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        port = free_port()
        with ThreadPoolExecutor(1) as thread:
            hosting = thread.submit(SyncGroup, "127.0.0.1", port, 0, 2, 30.0, "gloo")
            receiver = SyncGroup("127.0.0.1", port, 1, 2, 30.0, "gloo")
            sender = hosting.result(timeout=30)

            def send(x: torch.Tensor) -> None:
                total = torch.ones(1)
                dist.all_reduce(total)  # the default group, from the sender's thread
                sender.broadcast(x)

            for i in range(3):
                x = torch.arange(1000, dtype=torch.float32) * (i + 1)
                sending = thread.submit(send, x)
                y = torch.empty(1000)
                receiver.broadcast(y)
                sending.result(timeout=30)
                assert torch.equal(x, y)
        sender.close()
        receiver.close()
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dist.destroy_process_group()
