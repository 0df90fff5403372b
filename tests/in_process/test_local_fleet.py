"""LocalFleet and LocalTrainer as the loop sees them: the role protocols, logical engines (scale 1 → 2 → 1,
dispatch, per-engine figures and worker rows), staleness refusal and recovery, a failed sync and the next one, and
the train rank's life cycle in one process (start after start, thread count restored, checkpoint round trip)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from cluster.data.models import ModelError
from cluster.in_process import LocalFleet, LocalTrainer
from contract.errors import RecoveryDeferred
from contract.protocols import Fleet, Trainer
from contract.versions import PolicyVersionLedger
from tests.local_runtime import PROMPTS, RecordingSink, local_spec, requests_for, running, train_on

#: The rows ``cluster.ray_shell.fleet.EngineFleet.log_workers`` writes per engine.
WORKER_KEYS = {"policy_version", "perf/rollout_tokens_per_s", "rollout/queue_depth", "rollout/engine_busy_s",
               "rollout/kv_cache_usage", "workers/restarts"}


def test_the_runtime_implements_the_role_protocols(tiny_model_dir, tmp_path):
    spec = local_spec(tiny_model_dir, str(tmp_path))
    assert isinstance(LocalTrainer(spec), Trainer) and isinstance(LocalFleet(spec), Fleet)
    assert LocalTrainer(spec).world_size == 1
    with pytest.raises(TypeError, match="LocalTrainer"):
        LocalFleet(spec).start(tiny_model_dir, 0, object(), PolicyVersionLedger(), print)


def test_pre_start_checks_name_the_field(tiny_model_dir, tmp_path):
    """``check`` (run by the job before anything starts): LoRA targets against the model, one rank's layout."""
    LocalTrainer(local_spec(tiny_model_dir, str(tmp_path))).check(tiny_model_dir)
    LocalFleet(local_spec(tiny_model_dir, str(tmp_path))).check(tiny_model_dir)
    bad_target = local_spec(tiny_model_dir, str(tmp_path), train={"lora": {"rank": 4, "target_modules": ["qkv"]}})
    with pytest.raises(ModelError, match="train.lora.target_modules"):
        LocalTrainer(bad_target).check(tiny_model_dir)
    split = local_spec(tiny_model_dir, str(tmp_path), train={"strategy": "megatron", "world_size": 2,
                                                             "tensor_parallel_size": 2})
    with pytest.raises(ModelError, match="train.tensor_parallel_size: the in-process runtime runs one train rank"):
        LocalTrainer(split).check(tiny_model_dir)


def test_scale_dispatches_groups_over_logical_engines(tiny_model_dir, tmp_path):
    spec = local_spec(tiny_model_dir, str(tmp_path))
    with running(spec, tiny_model_dir) as (_, fleet, versions):
        sink = RecordingSink()
        requests = requests_for(fleet.tokenizer, PROMPTS)
        one = fleet.generate(requests)
        assert fleet.num_engines == 1 and fleet.restarts == 0 and fleet.figures.per_engine[0].groups == 4
        assert fleet.figures.tokens == sum(len(ids) for g in one for ids in g.response_ids)

        fleet.scale(2)
        assert fleet.num_engines == 2 and versions.engine_versions == [0, 0] and "2 engine(s)" in fleet.describe()
        fleet.begin_step()
        seen = []
        two = fleet.generate(requests, on_groups=lambda groups: seen.append([g.group_id for g in groups]))
        assert [g.response_ids for g in two] == [g.response_ids for g in one]  # the engine does not matter
        loads = fleet.figures.per_engine
        assert sorted(loads) == [0, 1] and all(e.groups >= 1 and e.tokens > 0 and e.seconds > 0
                                               for e in loads.values())
        assert sum(e.groups for e in loads.values()) == 4 and [len(ids) for ids in seen] == [loads[0].groups,
                                                                                            loads[1].groups]
        assert sorted(i for ids in seen for i in ids) == [0, 1, 2, 3]
        assert 0.2 < fleet.figures.idle_fraction < 0.8  # two engines taking turns on one model: about half idle
        fleet.log_workers(sink, step=1)
        assert [w[2] for w in sink.workers] == ["engine-0", "engine-1"]
        assert all(w[1] == "rollout" and set(w[3]) == WORKER_KEYS for w in sink.workers)
        assert sink.workers[1][3]["rollout/queue_depth"] == float(loads[1].groups)

        fleet.scale(1)
        assert fleet.num_engines == 1 and versions.engine_versions == [0]
        fleet.log_workers(sink, step=2)
        assert sink.removed == [("rollout", "engine-1")]
        with pytest.raises(ValueError, match="replicas must be >= 1"):
            fleet.scale(0)


def test_stale_groups_are_refused(tiny_model_dir, tmp_path):
    """``rollout.max_staleness`` 0: after a train step that was not synced, groups sampled on the old weights are
    refused: ``RecoveryDeferred`` without recovery (a generate overlapping training), else a resync and the same
    requests sampled again on the new weights."""
    spec = local_spec(tiny_model_dir, str(tmp_path))
    messages = []
    with running(spec, tiny_model_dir, status=messages.append) as (trainer, fleet, versions):
        requests = requests_for(fleet.tokenizer, PROMPTS[:2])
        train_on(trainer, versions, fleet.generate(requests))  # policy version 1, not synced
        with pytest.raises(RecoveryDeferred, match="2 stale group"):
            fleet.generate(requests, recover=False)
        assert fleet.model_version == 0
        fleet.begin_step()
        fresh = fleet.generate(requests)
        assert [g.policy_version for g in fresh] == [1, 1] and versions.engine_versions == [1]
        assert fleet.figures.stale_refused == 2 and any("re-syncing" in m for m in messages)


def test_train_rank_life_cycle_in_one_process(tiny_model_dir, tmp_path):
    spec = local_spec(tiny_model_dir, str(tmp_path), train={"num_threads": 1})
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        trainer = LocalTrainer(spec)
        trainer.start(tiny_model_dir)
        assert torch.get_num_threads() == 1 and dist.is_initialized() and trainer.num_parameters > 3e6
        assert "1 train rank" in trainer.describe()
        with pytest.raises(RuntimeError, match="default process group"):
            LocalTrainer(spec).start(tiny_model_dir)
        folder = tmp_path / "ckpt"
        trainer.save_checkpoint(str(folder))
        trainer.shutdown()
        trainer.shutdown()  # idempotent
        assert torch.get_num_threads() == 2 and not dist.is_initialized()

        resumed = LocalTrainer(spec)  # a second rank in the same process, from the checkpoint
        resumed.start(tiny_model_dir, policy_path=str(folder))
        assert resumed.load_checkpoint(str(folder), 3) == {} and resumed.policy_version == 3
        resumed.shutdown()
    finally:
        torch.set_num_threads(before)


def test_a_failed_sync_is_recovered_by_the_next(tiny_model_dir, tmp_path, monkeypatch):
    """The rank's sender fails before streaming: the sync fails within seconds (not ``sync.timeout_s``), names the
    rank, leaves every engine's version unknown and the model refusing to sample; the next generate syncs again
    (a new group) first, or defers without recovery."""
    spec = local_spec(tiny_model_dir, str(tmp_path), sync={"timeout_s": 120})
    with running(spec, tiny_model_dir) as (trainer, fleet, versions):
        requests = requests_for(fleet.tokenizer, PROMPTS[:1])
        train_on(trainer, versions, fleet.generate(requests))
        real = trainer.worker.broadcast_weights

        def failing(verify):
            monkeypatch.setattr(trainer.worker, "broadcast_weights", real)  # fails once
            raise RuntimeError("injected sender fault")

        monkeypatch.setattr(trainer.worker, "broadcast_weights", failing)
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="train rank 0: RuntimeError: injected sender fault"):
            fleet.sync_policy()
        assert time.perf_counter() - t0 < 30
        assert versions.engine_versions == [None] and fleet.model_version is None
        with pytest.raises(RecoveryDeferred, match="no complete policy"):
            fleet.generate(requests, recover=False)
        groups = fleet.generate(requests)
        assert groups[0].policy_version == 1 and versions.engine_versions == [1]
