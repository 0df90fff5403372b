"""The ``hf`` rollout engine: transformers' own model and a KV-cached decode loop, for machines where vLLM does not
install (and the in-process runtime's engine).

``HFEngine`` implements :class:`contract.rollout_engine.RolloutEngine` (``rollout.engine: hf`` in
``rollout_workers.registry``): under Ray an actor hosts it like the vLLM engine; the in-process runtime
(``cluster.in_process.LocalFleet``) builds one in the calling process. It samples with the same seeds, filters,
logprobs and stop strings as the vLLM engine (:mod:`rollout_workers.hf.sampling`: one row per completion, its own
generator seeded as vLLM seeds ``n=G`` requests, a token drawn as vLLM draws it), slower (no paged attention, no
continuous batching). Partial rollouts (``interrupt``, ``resume_from``) use the engines' shared bookkeeping
(:mod:`rollout_workers.partial`).

Weights: its own copy of the policy (never a tensor shared with a trainer), changed only by the weight sync. It joins
the sync group with the engines' shared receiving side (:class:`rollout_workers.weights.WeightReceiver`: the same
transports and checksums as the vLLM worker extension) and copies each received tensor into its model by name
(:mod:`rollout_workers.hf.model`); with ``train.lora.sync: adapter`` it wraps its model with the trainer's PEFT
adapter config when it joins, and reports after each sync the modules the adapter is bound to (read from PEFT).

Request-level serving (``contract.requests.RequestServer``: :meth:`HFEngine.submit`, and :meth:`HFEngine.serve` for
Ray callers): a batching thread over the model (:mod:`rollout_workers.hf.serving`); ``generate`` and the weight sync
pause its running batch (its requests keep their tokens and continue afterwards, every token stamped with its
version).

Shapes: B groups per call, G completions per group, R_i tokens of completion i.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from contract.affinity import pin_to_cores
from contract.console import route_worker_logs
from contract.messages import EngineInfo, GenerateStats, GroupRequest, GroupResult
from contract.model_source import ModelSource
from contract.requests import TokenRequest, TokenResult
from contract.sync_reports import ReceiveReport
from grpo.eos import eos_token_ids
from rollout_workers.hf.model import load_model, peft_bound_modules, sync_targets, with_adapters
from rollout_workers.hf.sampling import MAX_BATCH_ROWS, sample_groups
from rollout_workers.hf.serving import HFServer
from rollout_workers.info import engine_info
from rollout_workers.weights import WeightReceiver
from weight_sync.buckets import unpack_bucket

__all__ = ["HFEngine"]


class HFEngine:
    """A transformers model that samples groups and receives streamed weights (module docstring).

    Args:
        model_path, rollout, dtype, seed, max_model_len, policy_version, lora, source: as every engine
            (``contract.rollout_engine``); ``max_model_len`` is not reserved (the cache grows with the batch);
            ``seed`` seeds the completions of requests that carry none. ``rollout.cpu_affinity`` binds this process
            (and its torch threads, one per core) to those cores: the in-process runtime passes None.
        max_batch_rows: completions decoded together at most.

    Attributes:
        model: its policy copy (a PEFT model after an adapter sync joined). tokenizer: the model's tokenizer.
        eos_ids: the ids that end a completion (the model's ``generation_config`` EOS ids and the tokenizer's).
        policy_version: the version the model holds; None after a failed sync (it refuses to sample).
    """

    @staticmethod
    def lora_adapter_problem(architectures: list[str]) -> str | None:
        """None: PEFT wraps the linear layers of any architecture (the trainer checks the targets)."""
        return None

    def __init__(self, model_path: str, rollout, dtype: str, seed: int, max_model_len: int, policy_version: int = 0,
                 lora=None, source: ModelSource | None = None, max_batch_rows: int = MAX_BATCH_ROWS):
        from transformers import AutoTokenizer

        route_worker_logs(f"engine-{os.getpid()}")  # quiet console under `grpo-cluster run` (contract.console)
        if rollout.cpu_affinity is not None:
            pin_to_cores(rollout.cpu_affinity, "rollout.cpu_affinity")
            torch.set_num_threads(len(rollout.cpu_affinity))
        self.rollout = rollout
        self.max_batch_rows = max_batch_rows
        self.lora = lora
        source = source or ModelSource()
        on_gpu = torch.cuda.is_available() and rollout.num_gpus_per_replica > 0
        self.device = torch.device("cuda") if on_gpu else torch.device("cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, **source.hf_kwargs(model_path))
        self.model = load_model(model_path, dtype, self.device, source)
        config_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = eos_token_ids(config_eos, self.tokenizer.eos_token_id)
        self.policy_version: int | None = policy_version
        self._adapter = False  # wrapped with the trainer's adapters (train.lora.sync: adapter)
        self._targets: dict[str, torch.nn.Parameter] = {}
        self._weights = WeightReceiver()
        self._lock = threading.Lock()  # generate, the weight sync and a served batch never run at once
        self._interrupted_epoch = -1
        self._unseeded = random.Random(seed)  # seeds of requests that carry none
        self.server = HFServer(self)  # request-level serving (its thread starts with the first request)

    # ---- state ----------------------------------------------------------------------------------------------------
    def ready(self) -> EngineInfo:
        """Its policy version, process id and where it runs (:func:`rollout_workers.info.engine_info`)."""
        return engine_info(self.policy_version)

    def shutdown(self) -> None:
        """Stop request serving (unfinished requests end ``"abort"``), leave the sync group and drop the model
        (idempotent)."""
        self.server.close()
        self._weights.close()
        self.model = None
        self.policy_version = None

    def refuse_until_synced(self) -> None:
        """Hold no policy version until the next verified sync: the weights may be half-received (a sync that failed
        after some buckets loaded), so :meth:`generate` refuses to sample."""
        self.policy_version = None

    def unseeded_seed(self) -> int:
        """A seed for a completion whose request carries none (from the engine's seed)."""
        return self._unseeded.getrandbits(63)

    # ---- request-level serving --------------------------------------------------------------------------------------
    def submit(self, request: TokenRequest) -> Future[TokenResult]:
        """Serve ``request`` in the next decode batch (``contract.requests.RequestServer.submit``; thread-safe)."""
        return self.server.submit(request)

    def serve(self, request: TokenRequest) -> TokenResult:
        """:meth:`submit` and wait for the result: what a Ray caller runs, many at once (the rollout pool gives the
        actor a concurrency group of threads for it).

        Raises:
            ValueError: the request cannot be served (``rollout_workers.serving.check_request``).
        """
        return self.submit(request).result()

    def busy_seconds(self) -> float:
        """Cumulative seconds the engine spent serving requests (``TokenResult.busy_s``)."""
        return self.server.busy.seconds

    def decode(self, ids: list[int]) -> str:
        """Token ids → text, special tokens skipped."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- sampling -------------------------------------------------------------------------------------------------
    def interrupt(self, epoch: int) -> None:
        """Stop every generate call of ``interrupt_epoch`` <= ``epoch``, running or still to come, at its next token
        step (an integer assignment: safe from any thread while a call runs)."""
        self._interrupted_epoch = max(self._interrupted_epoch, int(epoch))

    def interrupted(self, interrupt_epoch: int | None) -> bool:
        """Whether a call of ``interrupt_epoch`` must stop now (None: never); checked before every token step."""
        return interrupt_epoch is not None and self._interrupted_epoch >= interrupt_epoch

    def generate(self, requests: list[GroupRequest], group_size: int, interrupt_epoch: int | None = None, *,
                 interrupted: Callable[[], bool] | None = None) -> tuple[list[GroupResult], GenerateStats]:
        """Sample every request's group (``contract.rollout_engine.RolloutEngine.generate``), all completions of the
        call in one :func:`rollout_workers.hf.sampling.sample_groups` call.

        Args:
            interrupted: checked before every token step instead of :meth:`interrupted` (the in-process fleet, whose
                logical engines share this one, keeps the interrupt epochs itself).

        Raises:
            RuntimeError: the model holds no complete policy after a failed weight sync.
            ValueError: a request's ``resume_from`` does not fit it.
        """
        with self.server.exclusively():
            version = self.policy_version
            if version is None or self.model is None:
                raise RuntimeError("the engine's model holds no complete policy after a failed weight sync; sync "
                                   "it before generating")
            t0 = time.perf_counter()
            groups = sample_groups(self.model, self.tokenizer, self.eos_ids, requests, self.rollout, version,
                                   self.unseeded_seed, interrupted or (lambda: self.interrupted(interrupt_epoch)),
                                   self.max_batch_rows, group_size=group_size)
            seconds = time.perf_counter() - t0
        prior = sum(len(ids) for q in requests if q.resume_from is not None for ids in q.resume_from.response_ids)
        tokens = sum(len(ids) for g in groups for ids in g.response_ids) - prior
        return groups, GenerateStats(seconds=seconds, tokens=tokens)

    # ---- weights --------------------------------------------------------------------------------------------------
    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, buckets, timeout_s: float,
                         backend: str = "gloo", channel: dict | None = None, adapter_config: dict | None = None
                         ) -> list[int]:
        """Join the sync group as rank ``rank_offset`` (one worker); with ``adapter_config`` (adapter sync) wrap the
        model with the trainer's adapters first (B = 0: the base model's outputs, policy version 0).

        Raises:
            ValueError: the plan's tensors are not the model's (names, shapes or dtypes differ; names them), after
                joining (the sender's side of the group forms, then this member leaves it).
            RuntimeError: the group did not form within ``timeout_s``.
        """
        with self.server.exclusively():
            if adapter_config is not None and not self._adapter:
                self.model = with_adapters(self.model, adapter_config)
                self._adapter = True
            self._targets = sync_targets(self.model, self._adapter)
            self._weights.join(host, port, rank_offset, world_size, buckets, timeout_s, backend, channel,
                               self.device if backend == "nccl" else None)
            try:
                self._check_plan()
            except ValueError:
                self._weights.close()
                raise
            return [rank_offset]

    def _check_plan(self) -> None:
        """Every planned tensor has a model tensor of the same shape and dtype, and every model tensor is planned."""
        slots = {s.name: s for b in self._weights.buckets for s in b.slots}
        missing, extra = sorted(set(slots) - set(self._targets)), sorted(set(self._targets) - set(slots))
        if missing or extra:
            raise ValueError(f"weight sync: the trainer's tensors are not the engine model's: {len(missing)} sent "
                             f"but absent from the model {missing[:4]}, {len(extra)} never sent {extra[:4]}")
        for name, slot in slots.items():
            t = self._targets[name]
            if tuple(t.shape) != slot.shape or str(t.dtype).removeprefix("torch.") != slot.dtype:
                raise ValueError(f"weight sync: tensor {name}: the trainer sends shape {slot.shape} {slot.dtype}, the "
                                 f"engine model holds {tuple(t.shape)} {t.dtype}")

    def close_weight_sync(self) -> None:
        """Leave the sync group."""
        self._weights.close()

    @torch.no_grad()
    def receive_weights(self, policy_version: int, verify: bool | list[str]) -> ReceiveReport:
        """Receive one sync into the model's tensors (each bucket checksummed as it arrives, then copied in by
        name) and serve ``policy_version``.

        Raises:
            RuntimeError: before :meth:`init_weight_sync`, or the transport failed. This member then leaves the group
                (a sender still blocked on it fails at once) and the version is None until a sync succeeds.
        """
        with self.server.exclusively():
            self.policy_version = None  # a partial load until every bucket is in
            check = self._weights.checked(verify)
            checksums: dict[str, int] = {}
            t0 = time.perf_counter()
            try:
                for bucket, buf in self._weights.received(check, checksums):
                    for name, tensor in unpack_bucket(bucket, buf):
                        self._targets[name].copy_(tensor)
            except BaseException:
                self._weights.close()
                raise
            self.policy_version = policy_version
            modules = [peft_bound_modules(self.model)] if self._adapter else None
            return ReceiveReport(policy_version=policy_version, seconds=time.perf_counter() - t0,
                                 bytes=self._weights.nbytes, worker_checksums=[checksums],
                                 worker_adapter_modules=modules)
