"""The train pool: ``train.world_size`` train ranks (the backend ``train.strategy`` names, from
``train_workers.registry``) in one placement group, and :class:`RayTrainer`, the ``contract.protocols.Trainer`` the
loop is given on a Ray cluster."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable

import ray
from ray.util.placement_group import remove_placement_group

from cluster.ray_shell.pools import (TrainWorkerFailure, _dead_actor_index, _in_group, _kill, _pool_placement_group,
                                     check_cluster_resources, get, wait_dead)
from cluster.spec.algorithm import effective_algorithm
from contract.goodput import PoolTime
from contract.messages import TrainRankInfo, TrainResult
from contract.model_source import ModelSource
from train_workers.registry import train_backend
from train_workers.step_metrics import COMPUTE_KEY


def import_user_modules(actor, modules: list[str], paths: list[str]) -> None:
    """Run inside a train-rank actor (``__ray_call__``): put ``paths`` (the driver's first ``sys.path`` entry, its
    working folder) on ``sys.path`` and import ``modules``, so the variants they register (loss aggregations, KL
    estimators, TIS/MIS levels, ...) are in this process's registries too.

    Raises:
        ImportError: a module does not import here (named, with the cause).
    """
    for path in paths:
        if path and path not in sys.path:
            sys.path.insert(0, path)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(f"--import {name}: not importable on the train rank: {exc}") from exc


class TrainPool:
    """``train.world_size`` train ranks forming one data-parallel process group, placed by one placement group
    (``train.placement_strategy``: PACK/SPREAD/...; bundle i holds rank i). The rank class is the train backend
    registered under ``train.strategy`` (``train_workers.registry``; FSDP2's ``FSDPTrainWorker`` for ``fsdp``).

    ``policy_path`` (a checkpoint folder, on resume) initialises the policy; the reference policy is ``model_path``.
    Every call reaches every rank together, waits at most ``train.timeout_s`` and names the rank that failed
    (:class:`TrainWorkerFailure`).

    Attributes:
        workers: the rank actors, rank order. infos: each rank's :class:`TrainRankInfo`.
        num_parameters: of the policy. busy_s: rank-seconds of the train steps so far (each rank's
        ``timing/train_compute_s``, summed).
    """

    def __init__(self, spec, model_path: str, policy_path: str | None = None, imports: tuple[str, ...] = ()):
        self.spec = spec
        self.busy_s = 0.0
        t = spec.train
        bundle = {"CPU": t.num_cpus_per_worker, "GPU": t.num_gpus_per_worker, **t.resources}
        actor_cls = ray.remote(train_backend(t.strategy))
        algorithm = effective_algorithm(spec.algorithm, spec.rollout)  # with the off-policy default, if it applies
        self.placement_group = _pool_placement_group([bundle] * t.world_size, t.placement_strategy,
                                                     f"{spec.name}-train", min(t.timeout_s, 120.0))
        self.workers = [
            actor_cls.options(num_cpus=t.num_cpus_per_worker, num_gpus=t.num_gpus_per_worker,
                              resources=dict(t.resources), **_in_group(self.placement_group, rank)).remote(
                rank, t.world_size, model_path, t, algorithm, spec.rollout.temperature,
                spec.rollout.max_response_tokens, spec.model.dtype, spec.seed,
                sampling_filters={"top_k": spec.rollout.top_k, "top_p": spec.rollout.top_p,
                                  "min_p": spec.rollout.min_p}, model_source=ModelSource.of(spec.model))
            for rank in range(t.world_size)
        ]
        try:
            if imports:  # variants a user registered (grpo-cluster run --import MODULE): every rank looks names up
                self._get([w.__ray_call__.remote(import_user_modules, list(imports), sys.path[:1])
                           for w in self.workers], t.timeout_s, f"importing {', '.join(imports)} on the train ranks")
            addr, port = self._get(self.workers[0].node_address.remote(), t.timeout_s, "train rank 0 address")
            infos = self._get([w.init_distributed.remote(addr, port, policy_path) for w in self.workers],
                              t.timeout_s, f"building the {t.strategy} train group")
        except BaseException:
            self.shutdown()
            raise
        self.infos: list[TrainRankInfo] = infos
        self.num_parameters = infos[0].num_parameters

    def _get(self, refs, timeout_s: float, what: str):
        try:
            return get(refs, timeout_s, what)
        except ray.exceptions.RayError as exc:
            rank = _dead_actor_index(self.workers, exc)
            who = f"train rank {rank}" if rank is not None else "a train rank"
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TrainWorkerFailure(f"{who} failed during {what}: {type(exc).__name__}: {cause}") from exc

    def _all(self, call: Callable, what: str) -> list:
        """``call(worker)`` (an actor method call returning an ObjectRef) on every rank together; every rank's
        result in rank order, within ``train.timeout_s``."""
        return self._get([call(w) for w in self.workers], self.spec.train.timeout_s, what)

    def set_kl_coef(self, kl_coef: float) -> None:
        """Set β on every rank for the following train steps (adaptive KL controller)."""
        self._all(lambda w: w.set_kl_coef.remote(kl_coef), "setting kl_coef")

    def set_lr(self, lr: float) -> None:
        """Set the learning rate on every rank for the following train steps (the loop's schedule)."""
        self._all(lambda w: w.set_lr.remote(lr), "setting the learning rate")

    def train_step(self, per_rank_microbatches: list, num_tokens: int, num_sequences: int) -> TrainResult:
        """One train step on every rank (rank r trains ``per_rank_microbatches[r]``); each rank's
        ``timing/train_compute_s`` is added to :attr:`busy_s`.

        Args:
            num_tokens, num_sequences: loss tokens, and sequences with at least one, over the whole batch.

        Returns:
            rank 0's :class:`TrainResult` (metrics are reduced over ranks, so every rank's are the same), with the
            ``token_logprobs`` of every rank's traced sequences.

        Raises:
            TrainWorkerFailure: a rank failed, or the ranks disagree on the policy version or the skip.
        """
        refs = [w.train_step.remote(mbs, num_tokens, num_sequences)
                for w, mbs in zip(self.workers, per_rank_microbatches)]
        results: list[TrainResult] = self._get(refs, self.spec.train.timeout_s, "train step")
        self.busy_s += sum(r.metrics.get(COMPUTE_KEY, 0.0) for r in results)
        first = results[0]
        for rank, r in enumerate(results[1:], start=1):
            if (r.policy_version, r.skipped) != (first.policy_version, first.skipped):
                raise TrainWorkerFailure(
                    f"train rank {rank} disagrees with rank 0 after the train step: policy version "
                    f"{r.policy_version} vs {first.policy_version}, skipped {r.skipped} vs {first.skipped}")
        traced = {row: logprobs for r in results for row, logprobs in r.token_logprobs.items()}
        return dataclasses.replace(first, token_logprobs=traced)

    def sync_plan(self, dtype: str, bucket_bytes: int) -> list:
        """The weight-sync bucket plan (``weight_sync.buckets.Bucket`` list) of the policy in the engine ``dtype``,
        buckets of at most ``bucket_bytes`` bytes; every rank computes it (rank 0's is returned)."""
        return self._all(lambda w: w.sync_plan.remote(dtype, bucket_bytes), "planning weight-sync buckets")[0]

    def sync_adapter_config(self) -> dict | None:
        """Train rank 0's PEFT ``adapter_config.json`` (a dict) when the engines receive adapters
        (``train.lora.sync: adapter``), else None."""
        return self._get(self.workers[0].sync_adapter_config.remote(), self.spec.train.timeout_s,
                         "reading the adapter config")

    def save_checkpoint(self, folder: str, checkpoint: str | None = None) -> None:
        """Every rank writes its part of a checkpoint (HF policy folder, sharded optimizer) into ``folder``;
        ``checkpoint`` names it in errors (default: ``folder``; the loop writes into a temporary folder)."""
        self._all(lambda w: w.save_checkpoint.remote(folder), f"saving checkpoint {checkpoint or folder}")

    def load_checkpoint(self, path: str, policy_version: int) -> dict[str, tuple]:
        """Every rank loads its optimizer state from the checkpoint at ``path`` and continues at ``policy_version``.

        Returns:
            optimizer field → (saved value, value in use) for fields the spec changed since the checkpoint.
        """
        return self._all(lambda w: w.load_checkpoint.remote(path, policy_version), f"loading checkpoint {path}")[0]

    def shutdown(self) -> None:
        for w in self.workers:
            _kill(w, None)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None


class RayTrainer:
    """The train side on a Ray cluster (``contract.protocols.Trainer``): a :class:`TrainPool` started by
    :meth:`start` (``ray.init`` must have been called), stopped by :meth:`shutdown`.

    Args:
        spec: the job spec.
        imports: modules every rank imports before it builds (``grpo-cluster run --import MODULE``: variants a user
            registered, which the ranks look up by name).

    Attributes:
        pool: the running pool (None before :meth:`start` and after :meth:`shutdown`).
        world_size: ``train.world_size``. num_parameters: of the policy (after :meth:`start`).
    """

    def __init__(self, spec, imports: tuple[str, ...] = ()):
        self.spec, self.imports = spec, tuple(imports)
        self.pool: TrainPool | None = None
        self.world_size = spec.train.world_size
        self.num_parameters = 0
        self._stopped_busy_s = 0.0  # rank-seconds of train steps of the pools this trainer stopped

    def check(self, model_path: str) -> None:
        """``train.lora`` against the model's layers (and the ``rollout.engine``'s LoRA support for ``sync:
        adapter``) and the backend's model-parallel layout (:mod:`cluster.data.model_checks`)."""
        from cluster.data.model_checks import check_lora, check_train_layout

        check_lora(self.spec.train.lora, model_path, engine=self.spec.rollout.engine,
                   source=ModelSource.of(self.spec.model))
        check_train_layout(self.spec.train, model_path, self.spec.model.dtype)

    def start(self, model_path: str, policy_path: str | None = None) -> None:
        """Check that the cluster can hold the job's pools, then start the ranks.

        Raises:
            InsufficientResources: the cluster lacks CPUs/GPUs/custom resources for the job's pools.
            TrainWorkerFailure: a rank failed to start (nothing stays running).
        """
        check_cluster_resources(self.spec)
        self.pool = TrainPool(self.spec, model_path, policy_path=policy_path, imports=self.imports)
        self.num_parameters = self.pool.num_parameters

    def _running(self) -> TrainPool:
        if self.pool is None:
            raise RuntimeError("the trainer is not started (RayTrainer.start)")
        return self.pool

    def set_kl_coef(self, kl_coef: float) -> None:
        self._running().set_kl_coef(kl_coef)

    def set_lr(self, lr: float) -> None:
        self._running().set_lr(lr)

    def train_step(self, per_rank: list, num_tokens: int, num_sequences: int) -> TrainResult:
        return self._running().train_step(per_rank, num_tokens, num_sequences)

    def pool_times(self) -> list[PoolTime]:
        """``contract.goodput.TimedPool``: the ranks (pool ``train``), their train-step seconds so far (each rank's
        ``timing/train_compute_s``) and the cores they hold (``train.num_cpus_per_worker`` each)."""
        ranks, busy = (len(self.pool.workers), self.pool.busy_s) if self.pool is not None else (0, 0.0)
        return [PoolTime("train", ranks, self._stopped_busy_s + busy,
                         cores=ranks * self.spec.train.num_cpus_per_worker)]

    def save_checkpoint(self, folder: str, checkpoint: str | None = None) -> None:
        self._running().save_checkpoint(folder, checkpoint)

    def load_checkpoint(self, path: str, policy_version: int) -> dict[str, tuple]:
        return self._running().load_checkpoint(path, policy_version)

    def describe(self) -> str:
        return f"{len(self._running().workers)} train rank(s), {self.num_parameters / 1e6:.1f}M parameters"

    def shutdown(self) -> None:
        """Kill the ranks and wait until they are gone (a restart on the same nodes finds their ports free)."""
        if self.pool is None:
            return
        pool, self.pool = self.pool, None
        self._stopped_busy_s += pool.busy_s
        workers = list(pool.workers)
        pool.shutdown()
        wait_dead(workers)
