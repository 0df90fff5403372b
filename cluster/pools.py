"""Worker pools: Ray actors for the rollout engines and the FSDP2 train ranks.

The pools own actor creation (resources from the spec), the calls that must reach every member together, timeouts
(every ``ray.get`` names the operation and its limit), and the weight-sync group joining train rank 0 with every
engine worker.
"""

from __future__ import annotations

import ray

from rollout_workers.engine import GroupRequest, GroupResult, RolloutEngine
from train_workers.fsdp_worker import FSDPTrainWorker


class WorkerTimeout(TimeoutError):
    """A remote call did not finish within its limit."""


class SyncVerificationError(RuntimeError):
    """An engine's received weights differ from what the trainer sent."""


class InsufficientResources(RuntimeError):
    """The Ray cluster lacks the CPUs/GPUs the spec's pools ask for."""


def check_cluster_resources(spec) -> None:
    """Fail at once, listing what is missing, when the cluster cannot hold the pools (Ray would wait forever).

    Raises:
        InsufficientResources: e.g. ``needs GPU 3 (rollout 1 x 1 + train 2 x 1), cluster has 0``.
    """
    r, t = spec.rollout, spec.train
    have = ray.cluster_resources()
    need = {
        "CPU": (r.replicas * r.num_cpus_per_replica + t.world_size * t.num_cpus_per_worker,
                f"rollout {r.replicas} x {r.num_cpus_per_replica:g} + train {t.world_size} x "
                f"{t.num_cpus_per_worker:g}"),
        "GPU": (r.replicas * r.num_gpus_per_replica + t.world_size * t.num_gpus_per_worker,
                f"rollout {r.replicas} x {r.num_gpus_per_replica:g} + train {t.world_size} x "
                f"{t.num_gpus_per_worker:g}"),
    }
    missing = [f"{res} {amount:g} ({how}), cluster has {have.get(res, 0):g}"
               for res, (amount, how) in need.items() if amount > have.get(res, 0) + 1e-9]
    if missing:
        raise InsufficientResources("the Ray cluster cannot hold this job: needs " + "; needs ".join(missing))


def get(refs, timeout_s: float, what: str):
    """``ray.get`` with a timeout that raises :class:`WorkerTimeout` naming ``what``."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise WorkerTimeout(f"{what} did not finish within {timeout_s:g} s") from None


class RolloutPool:
    """``rollout.replicas`` vLLM engine actors.

    Groups are dispatched by load: each prompt's whole group goes to the engine with the fewest assigned tokens
    (prompt + G × max_response_tokens), largest prompts first, so engines finish together and a group's G samples share
    one engine's prefix cache.
    """

    def __init__(self, spec, model_path: str, max_model_len: int):
        self.spec = spec
        r = spec.rollout
        actor_cls = ray.remote(RolloutEngine)
        self.engines = [
            actor_cls.options(num_cpus=r.num_cpus_per_replica, num_gpus=r.num_gpus_per_replica,
                              name=None).remote(model_path, r, spec.model.dtype, spec.seed + i, max_model_len)
            for i in range(r.replicas)
        ]
        get([e.ready.remote() for e in self.engines], r.timeout_s, "starting the rollout engines")

    def generate(self, requests: list[GroupRequest]) -> tuple[list[GroupResult], dict]:
        """Sample one group per request across the engines; results come back in request order."""
        r = self.spec.rollout
        load = [0] * len(self.engines)
        assigned: list[list[GroupRequest]] = [[] for _ in self.engines]
        for req in sorted(requests, key=lambda q: (-len(q.prompt_ids), q.group_id)):
            i = min(range(len(self.engines)), key=lambda k: (load[k], k))
            assigned[i].append(req)
            load[i] += len(req.prompt_ids) + r.group_size * r.max_response_tokens
        refs = [e.generate.remote(reqs, r.group_size) for e, reqs in zip(self.engines, assigned) if reqs]
        outs = get(refs, r.timeout_s, f"generating {len(requests)} groups")
        by_id = {res.group_id: res for results, _ in outs for res in results}
        tokens = sum(stats["tokens"] for _, stats in outs)
        busy = [stats["seconds"] for _, stats in outs]
        return [by_id[q.group_id] for q in requests], {"tokens": tokens, "engine_seconds": busy}


class TrainPool:
    """``train.world_size`` FSDP2 ranks forming one data-parallel process group."""

    def __init__(self, spec, model_path: str):
        self.spec = spec
        t = spec.train
        actor_cls = ray.remote(FSDPTrainWorker)
        self.workers = [
            actor_cls.options(num_cpus=t.num_cpus_per_worker, num_gpus=t.num_gpus_per_worker).remote(
                rank, t.world_size, model_path, t, spec.algorithm, spec.rollout.temperature,
                spec.rollout.max_response_tokens, spec.model.dtype, spec.seed)
            for rank in range(t.world_size)
        ]
        addr, port = get(self.workers[0].node_address.remote(), t.timeout_s, "train rank 0 address")
        infos = get([w.init_distributed.remote(addr, port) for w in self.workers], t.timeout_s,
                    "building the FSDP2 train group")
        self.num_parameters = infos[0]["num_parameters"]

    def all(self, method: str, *args, timeout_s: float | None = None, what: str | None = None):
        """Call ``method`` on every rank together and return every rank's result."""
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return get(refs, timeout_s or self.spec.train.timeout_s, what or f"train {method}")

    def train_step(self, per_rank_microbatches, num_tokens: int, num_sequences: int) -> dict:
        refs = [w.train_step.remote(mbs, num_tokens, num_sequences)
                for w, mbs in zip(self.workers, per_rank_microbatches)]
        return get(refs, self.spec.train.timeout_s, "train step")[0]


class WeightSync:
    """The broadcast group (train rank 0 + every engine worker) and one verified sync per optimizer step."""

    def __init__(self, spec, train: TrainPool, rollout: RolloutPool):
        self.spec, self.train, self.rollout = spec, train, rollout
        s = spec.sync
        buckets = train.all("sync_plan", spec.model.dtype, s.bucket_bytes, what="planning weight-sync buckets")[0]
        self.num_buckets = len(buckets)
        self.bytes_per_sync = sum(b.nbytes for b in buckets)
        host, port = get(train.workers[0].node_address.remote(), s.timeout_s, "train rank 0 address")
        tp = spec.rollout.tensor_parallel_size
        world = 1 + len(rollout.engines) * tp
        refs = [train.workers[0].init_sync_group.remote(host, port, world, s.timeout_s)]
        refs += [e.init_weight_sync.remote(host, port, 1 + i * tp, world, buckets, s.timeout_s,
                                           "nccl" if spec.rollout.num_gpus_per_replica > 0 else "gloo")
                 for i, e in enumerate(rollout.engines)]
        get(refs, s.timeout_s, "forming the weight-sync group")

    def sync(self, policy_version: int) -> dict:
        """Stream the current policy to every engine; verify checksums when ``sync.verify``.

        Raises:
            SyncVerificationError: a tensor's checksum on an engine differs from the trainer's (names both).
        """
        s = self.spec.sync
        send = [w.broadcast_weights.remote(s.verify) for w in self.train.workers]
        recv = [e.receive_weights.remote(policy_version, s.verify) for e in self.rollout.engines]
        results = get(send + recv, s.timeout_s, f"weight sync to policy version {policy_version}")
        sent, received = results[0], results[len(send):]
        if sent["policy_version"] != policy_version:
            raise RuntimeError(f"trainer is at policy version {sent['policy_version']}, expected {policy_version}")
        verified = False
        if s.verify:
            for i, report in enumerate(received):
                for w, checksums in enumerate(report["worker_checksums"]):
                    _compare_checksums(sent["checksums"], checksums, f"engine {i} worker {w}")
            verified = True
        seconds = max(r["seconds"] for r in results)
        return {"sync/verified": verified, "sync/bytes": float(sent["bytes"]), "sync/buckets": self.num_buckets,
                "sync/seconds_sender": sent["seconds"],
                "sync/gb_per_s": sent["bytes"] / max(seconds, 1e-9) / 1e9}


def _compare_checksums(sent: dict[str, int], got: dict[str, int], who: str) -> None:
    if set(sent) != set(got):
        missing, extra = sorted(set(sent) - set(got)), sorted(set(got) - set(sent))
        raise SyncVerificationError(f"{who}: received tensor set differs: missing {missing[:5]}, extra {extra[:5]}")
    for name, crc in sent.items():
        if got[name] != crc:
            raise SyncVerificationError(
                f"{who}: tensor {name} checksum mismatch: trainer crc32 {crc:#010x}, engine crc32 {got[name]:#010x}")
