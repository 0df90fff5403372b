"""The in-process train side: one train rank of the spec's backend, in the calling process.

:class:`LocalTrainer` implements :class:`contract.protocols.Trainer` with ONE rank (W = 1) of the backend
``train.strategy`` names (``train_workers.registry.train_backend``; FSDP2's ``FSDPTrainWorker`` for ``fsdp``), built
with the arguments ``cluster.ray_shell.train_pool.TrainPool`` gives a rank, and calls the rank's
:class:`contract.train_worker.TrainWorker` methods directly (no Ray). Its process group is torch.distributed's default
group of this process, a gloo (or NCCL) group of one over loopback TCP; :meth:`LocalTrainer.shutdown` destroys it, so
another LocalTrainer can start later in the same process (several jobs one after another in one pytest run), but two
cannot run at once.

The caller's process is left as it was found where the rank would change it: ``train.cpu_affinity`` is cleared (the
rank never pins the process) and torch's intra-op thread count (``train.num_threads``) is restored on shutdown.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cluster.in_process.progress import library_progress_bars
from cluster.spec.algorithm import effective_algorithm
from contract.batches import PackedMicroBatch
from contract.goodput import PoolTime
from contract.messages import TrainRankInfo, TrainResult
from contract.model_source import ModelSource
from train_workers.registry import train_backend
from train_workers.step_metrics import COMPUTE_KEY

__all__ = ["LocalTrainer"]


class LocalTrainer:
    """One train rank of ``spec.train.strategy``'s backend in this process (:class:`contract.protocols.Trainer`).

    Args:
        spec: the validated job spec (``train``, ``algorithm``, ``rollout`` temperature, filters and length cap,
            ``model.dtype``, ``seed``).

    Attributes:
        world_size: 1 (the loop plans micro-batches for this many ranks).
        num_parameters: of the policy, after :meth:`start` (0 before).
        worker: the rank (a ``TrainWorker``), None before :meth:`start` and after :meth:`shutdown`; the in-process
            fleet calls its weight-sync methods.
        info: the rank's :class:`TrainRankInfo` after :meth:`start`.
    """

    world_size = 1

    def __init__(self, spec, *, progress: bool = True):
        self.spec = spec
        self.progress = progress
        self.num_parameters = 0
        self.worker = None
        self.info: TrainRankInfo | None = None
        self._threads: int | None = None  # torch's thread count before the rank was built
        self._busy_s = 0.0  # the rank's timing/train_compute_s over every train step

    def _train_spec(self):
        """``train`` as the one rank gets it: ``world_size`` 1, ``cpu_affinity`` cleared."""
        return self.spec.train.model_copy(update={"world_size": 1, "cpu_affinity": None})

    def check(self, model_path: str) -> None:
        """Pre-start checks against the model (starts nothing): ``train.lora`` targets and rank
        (``cluster.data.model_checks.check_lora`` with the ``hf`` engine, which serves any PEFT adapter), the
        backend's layout for one rank (``check_train_layout``).

        Raises:
            ModelError: naming the spec field; ``train.tensor_parallel_size`` or ``train.pipeline_parallel_size``
                above 1 (a model split over several ranks cannot run as one rank).
        """
        from cluster.data.models import ModelError
        from cluster.data.model_checks import check_lora, check_train_layout

        for field in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self.spec.train, field) != 1:
                raise ModelError(f"train.{field}: the in-process runtime runs one train rank, expected 1, got "
                                 f"{getattr(self.spec.train, field)}")
        check_lora(self.spec.train.lora, model_path, engine="hf", source=ModelSource.of(self.spec.model))
        check_train_layout(self._train_spec(), model_path, self.spec.model.dtype)

    @property
    def policy_version(self) -> int:
        """The rank's policy version (``TrainWorker.policy_version``).

        Raises:
            RuntimeError: before :meth:`start`.
        """
        return self._rank().policy_version

    def _rank(self):
        if self.worker is None:
            raise RuntimeError("LocalTrainer: the train rank is not running; call start() first")
        return self.worker

    def start(self, model_path: str, policy_path: str | None = None) -> None:
        """Build the rank: its process group (torch.distributed's default group, world size 1), the policy from
        ``policy_path`` (a checkpoint's policy folder, on resume) or ``model_path``, the reference policy from
        ``model_path``, the optimizer.

        Raises:
            RuntimeError: this process already has a default process group (another LocalTrainer running, or code
                that called ``init_process_group``), or the trainer is started already. The backend's errors
                (nothing stays running: the group is destroyed and the thread count restored).
        """
        if self.worker is not None:
            raise RuntimeError("LocalTrainer.start: the train rank is running already")
        if dist.is_initialized():
            raise RuntimeError("LocalTrainer.start: torch.distributed's default process group is initialised in "
                               "this process already (another LocalTrainer running?); the in-process train rank "
                               "needs it: shut the other one down first")
        s = self.spec
        train = self._train_spec()
        filters = {"top_k": s.rollout.top_k, "top_p": s.rollout.top_p, "min_p": s.rollout.min_p}
        algorithm = effective_algorithm(s.algorithm, s.rollout)  # with the off-policy default, if it applies
        self._threads = torch.get_num_threads()
        try:
            with library_progress_bars(self.progress):
                self.worker = train_backend(train.strategy)(
                    0, 1, model_path, train, algorithm, s.rollout.temperature, s.rollout.max_response_tokens,
                    s.model.dtype, s.seed, sampling_filters=filters, model_source=ModelSource.of(s.model))
                host, port = self.worker.node_address()
                self.info = self.worker.init_distributed(host, port, policy_path)
        except BaseException:
            self.shutdown()
            raise
        self.num_parameters = self.info.num_parameters

    def set_kl_coef(self, kl_coef: float) -> None:
        """Set β for the following train steps (``TrainWorker.set_kl_coef``; its ValueError on a bad value)."""
        self._rank().set_kl_coef(kl_coef)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of the following train steps (``TrainWorker.set_lr``; its ValueError)."""
        self._rank().set_lr(lr)

    def train_step(self, per_rank: list[list[PackedMicroBatch]], num_tokens: int, num_sequences: int
                   ) -> TrainResult:
        """One policy update on ``per_rank[0]`` (``TrainWorker.train_step``).

        Raises:
            ValueError: ``per_rank`` does not hold exactly one list (W = 1).
        """
        if len(per_rank) != 1:
            raise ValueError(f"LocalTrainer.train_step: expected micro-batches for 1 train rank (world_size 1), got "
                             f"{len(per_rank)} lists")
        result = self._rank().train_step(per_rank[0], num_tokens, num_sequences)
        self._busy_s += result.metrics.get(COMPUTE_KEY, 0.0)
        return result

    def pool_times(self) -> list[PoolTime]:
        """``contract.goodput.TimedPool``: the one rank (pool ``train``) and its train-step seconds so far; no cores of
        its own (it runs in the driver's process)."""
        return [PoolTime("train", 1 if self.worker is not None else 0, self._busy_s)]

    def reference_logprobs(self, mb: PackedMicroBatch) -> torch.Tensor | None:
        """The reference policy's logprobs of ``mb`` ([n, T] float32; ``TrainWorker.reference_logprobs``)."""
        return self._rank().reference_logprobs(mb)

    def save_checkpoint(self, folder: str, checkpoint: str | None = None) -> None:
        """Write the rank's policy folder and optimizer state into ``folder`` (``TrainWorker.save_checkpoint``).

        Raises:
            RuntimeError: the backend failed, naming ``checkpoint`` (default ``folder``); its error is the cause.
        """
        try:
            self._rank().save_checkpoint(folder)
        except Exception as exc:
            raise RuntimeError(f"train rank 0 failed saving checkpoint {checkpoint or folder}: "
                               f"{type(exc).__name__}: {exc}") from exc

    def load_checkpoint(self, path: str, policy_version: int) -> dict[str, tuple]:
        """Load checkpoint ``path``'s optimizer state, continue at ``policy_version``
        (``TrainWorker.load_checkpoint``); returns ``{field: (saved, in use)}`` of changed optimizer fields."""
        return self._rank().load_checkpoint(path, policy_version)

    def describe(self) -> str:
        """``"1 train rank (fsdp, in process), 3.2M parameters"``."""
        return (f"1 train rank ({self.spec.train.strategy}, in process), {self.num_parameters / 1e6:.1f}M "
                f"parameters")

    def shutdown(self) -> None:
        """Close the rank's weight-sync group, destroy its process group and restore torch's thread count
        (idempotent). Afterwards another LocalTrainer may start in this process."""
        worker, self.worker = self.worker, None
        try:
            if worker is not None:
                try:
                    worker.close_sync_group()
                finally:
                    worker.shutdown()
        finally:
            if self._threads is not None and torch.get_num_threads() != self._threads:
                torch.set_num_threads(self._threads)
            self._threads = None
