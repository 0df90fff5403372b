"""The ``vllm`` rollout engine: one vLLM engine that samples groups of completions with per-token logprobs.

``VLLMEngine`` implements :class:`contract.rollout_engine.RolloutEngine` (registered as ``rollout.engine: vllm`` in
``rollout_workers.registry``); it is a plain class (tests build it in-process) that the Ray shell wraps with
``ray.remote``, its resources set from the spec. Every completion of a prompt's group is sampled by the same engine in
one request (``SamplingParams(n=G)``), which shares the prompt's KV cache. Logprobs are vLLM's ``processed_logprobs``:
the log-probability of each sampled token under the distribution actually sampled from (logits / temperature, then the
min-p, top-k and top-p filters, renormalised); the trainer computes the same (``grpo.logprobs.filter_logits_``).

LoRA adapter sync (``train.lora.sync: adapter``): the engine starts with vLLM's LoRA support (``enable_lora``, one
adapter slot, ``max_lora_rank`` the smallest vLLM allows that holds ``train.lora.rank``) from the base model; after
each sync it serves the received adapter (the policy version's ``LoRARequest``) with every request. Before the first
sync it serves the base, which is policy version 0 (LoRA's ``B = 0`` initialisation).

Partial rollouts (``rollout.partial_rollout``, :mod:`rollout_workers.partial`): a call given an ``interrupt_epoch``
(or resuming interrupted groups) steps the engine itself, one request per completion, and checks between engine steps
whether :meth:`VLLMEngine.interrupt` was called for that epoch; if so it aborts the unfinished requests through
vLLM (``LLMEngine.abort_request``) and returns them with finish reason ``"interrupted"``. The Ray actor then has two
concurrency slots (``max_concurrency=2``, ``cluster.ray_shell.rollout_pool``) so that ``interrupt`` runs while
``generate`` does; every method that touches the vLLM engine holds :attr:`VLLMEngine._engine_lock`, so ``generate``
and the weight sync never run at once, whatever the caller does.

Request-level serving (``contract.requests.RequestServer``: :meth:`VLLMEngine.submit`, and :meth:`VLLMEngine.serve`
for Ray callers): a thread steps vLLM's engine and adds requests between steps (:mod:`rollout_workers.vllm.serving`);
``generate`` and the weight sync pause the requests running then (aborted keeping their tokens, continued afterwards
on the engine's weights then, every token stamped with its version).

Shapes: B prompts per call, G completions per prompt, R_i tokens in completion i.

Every vLLM-specific piece of the project lives in this folder: the engine, its worker extension that receives
weights (``extension``), its CPU settings (``cpu``), option mapping and checks (``config``) and its loggers
(``console``).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import Future

import torch

from contract.affinity import pin_to_cores
from contract.messages import EngineInfo, GenerateStats, GroupRequest, GroupResult
from contract.model_source import ModelSource
from contract.requests import TokenRequest, TokenResult
from contract.sync_reports import ReceiveReport
from rollout_workers.info import engine_info
from rollout_workers.partial import CompletionState, assemble_group, completion_jobs
from rollout_workers.stops import StopScanner
from rollout_workers.vllm.config import engine_lora_rank, lora_adapter_problem, source_kwargs
from rollout_workers.vllm.console import route_vllm_logs
from rollout_workers.vllm.cpu import configure_cpu_env, core_ranges, cpu_engine_kwargs
from rollout_workers.vllm.serving import VLLMServer

__all__ = ["EXTENSION_CLS", "VLLMEngine"]

EXTENSION_CLS = "rollout_workers.vllm.extension.WeightSyncExtension"


class VLLMEngine:
    """A vLLM engine plus the weight-sync extension on its workers (:class:`contract.rollout_engine.RolloutEngine`).

    Args:
        model_path: local HF folder (or hub id).
        rollout: the spec's ``RolloutSpec`` (temperature, top_p, top_k, min_p, max_response_tokens, stop, engine
            options).
        dtype: engine dtype name (``float32`` on CPU).
        seed: engine seed (sampling is reproducible for a fixed seed and request order).
        max_model_len: context length the engine reserves per sequence.
        policy_version: version of the weights in ``model_path`` (0 for the initial model, a checkpoint's version on
            resume); the driver syncs newer weights before the engine serves.
        lora: the spec's ``train.lora`` (a ``LoraSpec``) or None; with ``sync: adapter`` the engine serves LoRA
            adapters (``enable_lora``) and every request carries the synced policy's adapter.
        source: how the model is loaded (``model.revision``, ``model.trust_remote_code``:
            :class:`contract.model_source.ModelSource`); None: the defaults.

    Attributes:
        lora_request: the ``LoRARequest`` of the policy version's adapter that every request carries (adapter sync
            after a sync), else None (the engine's own weights are the policy).
    """

    def __init__(self, model_path: str, rollout, dtype: str, seed: int, max_model_len: int, policy_version: int = 0,
                 lora=None, source: ModelSource | None = None):
        on_gpu = torch.cuda.is_available() and rollout.num_gpus_per_replica > 0
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        route_vllm_logs(f"engine-{os.getpid()}")  # quiet console (contract.console), before vLLM loads
        if rollout.cpu_affinity is not None:  # before vLLM starts its processes, which inherit the binding
            pin_to_cores(rollout.cpu_affinity, "rollout.cpu_affinity", core_ranges)
        if not on_gpu:
            configure_cpu_env(rollout.kv_cache_gib, rollout.cpu_affinity, rollout.tensor_parallel_size)
        from vllm import LLM

        self.rollout = rollout
        self.policy_version = policy_version
        self.lora_request = None
        # Held by every method that touches the vLLM engine (generate, the weight sync): with two concurrency slots
        # (partial rollouts) only interrupt() and ready() may run beside them.
        self._engine_lock = threading.Lock()
        self.server = VLLMServer(self)  # request-level serving (its thread starts with the first request)
        self._interrupted_epoch = -1  # the newest epoch interrupt() was called with
        self._request_ids = itertools.count()
        self.inflight_tokens = 0  # new tokens sampled so far by the running stepped call (progress, for tests)
        lora_kwargs = {}
        if lora is not None and lora.sync == "adapter":
            lora_kwargs = dict(enable_lora=True, max_loras=1, max_lora_rank=engine_lora_rank(lora.rank))
        cpu_kwargs = {} if on_gpu else cpu_engine_kwargs(max_model_len)
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=rollout.enforce_eager,
            tensor_parallel_size=rollout.tensor_parallel_size,
            gpu_memory_utilization=rollout.gpu_memory_utilization if on_gpu else 0.2,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION_CLS,
            **lora_kwargs,
            **cpu_kwargs,
            **source_kwargs(source or ModelSource(), model_path),
        )
        try:  # KV-cache capacity in tokens, as the engine core sized it at start-up
            cache = self.llm.llm_engine.vllm_config.cache_config
            self.kv_capacity_tokens = int(cache.num_gpu_blocks) * int(cache.block_size)
        except (AttributeError, TypeError, ValueError):
            self.kv_capacity_tokens = None

    lora_adapter_problem = staticmethod(lora_adapter_problem)

    def ready(self) -> EngineInfo:
        """Cheap liveness probe: the engine's policy version, process id, and where it really runs
        (:func:`engine_info`)."""
        return engine_info(self.policy_version)

    def shutdown(self) -> None:
        """Stop request serving (unfinished requests end ``"abort"``); vLLM's engine processes end with this one (a
        Ray actor is killed)."""
        self.server.close()

    # ---- request-level serving --------------------------------------------------------------------------------------
    def submit(self, request: TokenRequest) -> Future[TokenResult]:
        """Serve ``request`` as soon as the engine can (``contract.requests.RequestServer.submit``; thread-safe)."""
        return self.server.submit(request)

    def serve(self, request: TokenRequest) -> TokenResult:
        """:meth:`submit` and wait for the result: what a Ray caller runs, many at once (the rollout pool gives the
        actor a concurrency group of threads for it).

        Raises:
            ValueError: the request cannot be served (``rollout_workers.serving.check_request``, vLLM's refusal).
        """
        return self.submit(request).result()

    def busy_seconds(self) -> float:
        """Cumulative seconds the engine spent serving requests (``TokenResult.busy_s``)."""
        return self.server.busy.seconds

    def request_params(self, request: TokenRequest, max_tokens: int, seed: int | None):
        """The ``SamplingParams`` of one segment of a served request: its sampling settings and stop strings (kept in
        the output), ``max_tokens`` and ``seed`` of the segment, per-token logprobs, DELTA outputs."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        stops = {"stop": list(request.stop), "include_stop_str_in_output": True} if request.stop else {}
        return SamplingParams(n=1, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                              min_p=request.min_p, max_tokens=max_tokens, seed=seed, logprobs=0,
                              skip_special_tokens=True, output_kind=RequestOutputKind.DELTA, **stops)

    def interrupt(self, epoch: int) -> None:
        """Interrupt every ``generate`` call of ``interrupt_epoch`` <= ``epoch``, running or still to come (partial
        rollouts): it aborts its unfinished requests at the next engine step and returns them as partial completions.

        Only records ``epoch`` (one integer assignment, atomic under the GIL): it runs in the actor's second
        concurrency slot while ``generate`` runs in the first. An epoch rather than an event that ``generate`` would
        clear: an interrupt may reach the actor before a call of the same epoch starts (Ray orders nothing between
        the two slots), and that call must stop as well.
        """
        self._interrupted_epoch = max(self._interrupted_epoch, int(epoch))

    def generate(self, requests: list[GroupRequest], group_size: int, interrupt_epoch: int | None = None
                 ) -> tuple[list[GroupResult], GenerateStats]:
        """Sample ``group_size`` completions for each request (``request.group_size`` when set), with the spec's
        rollout sampling settings or the request's ``sampling`` override.

        Args:
            interrupt_epoch: (partial rollouts) the call stops early when :meth:`interrupt` is called with an epoch
                >= this one; None: it runs to the end. A call with an ``interrupt_epoch`` or a request with
                ``resume_from`` steps the engine itself (:meth:`_generate_stepped`); otherwise ``LLM.generate`` runs
                it (one ``n=G`` request per group).

        Raises:
            RuntimeError: the weights are inconsistent after a failed sync, or vLLM reports a prompt other than the
                request's ``prompt_ids`` (training would score completions of a prompt the engine did not see).
            ValueError: a request's ``resume_from`` does not fit it (:func:`rollout_workers.partial.completion_jobs`).

        Returns:
            (results in request order, :class:`GenerateStats`): busy seconds, response tokens sampled by this call,
            and the estimated peak fraction of the KV cache the call used (prompt + completion tokens of all its
            requests over the cache's token capacity; None when the capacity is unknown).
        """
        with self.server.exclusively(pause=True):
            if self.policy_version is None:
                raise RuntimeError("engine weights are inconsistent after a failed weight sync; sync it before "
                                   "generating")
            if interrupt_epoch is not None or any(r.resume_from is not None for r in requests):
                return self._generate_stepped(requests, group_size, interrupt_epoch)
            return self._generate_whole(requests, group_size)

    def _kv_usage(self, kv_tokens: int) -> float | None:
        """``kv_tokens`` over the cache's token capacity, at most 1 (None when the capacity is unknown)."""
        if not self.kv_capacity_tokens:
            return None
        return min(1.0, kv_tokens / self.kv_capacity_tokens)

    def _generate_stepped(self, requests: list[GroupRequest], group_size: int, interrupt_epoch: int | None
                          ) -> tuple[list[GroupResult], GenerateStats]:
        """``generate`` one request per completion (:func:`rollout_workers.partial.completion_jobs`), stepping
        ``llm_engine`` and checking for an interrupt of ``interrupt_epoch`` between steps; aborted completions come
        back ``"interrupted"`` with their tokens so far, each token with the policy version that sampled it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        t0 = time.perf_counter()
        version = self.policy_version
        self.inflight_tokens = 0
        tokenizer = self.llm.get_tokenizer()
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        per_group: list[dict] = [{} for _ in requests]  # sample index -> (job, state)
        by_id: dict[str, tuple] = {}  # request id -> (job, state)
        scanners: dict[str, StopScanner] = {}  # continued completions: stop strings across the interruption
        try:
            for k, r in enumerate(requests):
                sampling = self._sampling(r)
                for job in completion_jobs(r, group_size, sampling.pop("max_tokens")):
                    params = SamplingParams(n=1, **sampling, max_tokens=job.max_tokens, logprobs=0,
                                            skip_special_tokens=True, seed=job.seed,
                                            output_kind=RequestOutputKind.DELTA)
                    rid = f"grpo-{next(self._request_ids)}"
                    engine.add_request(rid, TokensPrompt(prompt_token_ids=job.prompt_ids), params,
                                       lora_request=self.lora_request)
                    by_id[rid] = per_group[k][job.sample] = (job, CompletionState())
                    if job.prefix_ids and self.rollout.stop:
                        scanners[rid] = StopScanner(self.rollout.stop, decode, job.prefix_ids)
            while engine.has_unfinished_requests():
                if interrupt_epoch is not None and self._interrupted_epoch >= interrupt_epoch:
                    engine.abort_request([rid for rid, (_, st) in by_id.items() if st.finish_reason is None])
                    break
                for out in engine.step():
                    job, state = by_id[out.request_id]
                    comp = out.outputs[0]
                    tok = list(comp.token_ids)
                    lps = [step[t].logprob for t, step in zip(tok, comp.logprobs or [])]
                    scanner = scanners.get(out.request_id)
                    hit = next((i for i, t in enumerate(tok) if scanner.add(t)), None) if scanner else None
                    if hit is not None:  # a stop string begun before the interruption, completed now
                        tok, lps = tok[:hit + 1], lps[:hit + 1]
                    state.add(tok, lps, comp.text if hit is None else "")
                    self.inflight_tokens += len(tok)
                    if hit is not None:
                        state.finish_reason, state.stop_reason = "stop", scanner.stop_reason
                        if not out.finished:
                            engine.abort_request([out.request_id])
                    elif out.finished:
                        state.finish_reason = comp.finish_reason or "stop"
        except BaseException:
            engine.abort_request([rid for rid, (_, st) in by_id.items() if st.finish_reason is None])
            raise
        results = [assemble_group(r, group_size, per_group[k], version, decode) for k, r in enumerate(requests)]
        tokens = sum(len(st.ids) for _, st in by_id.values())
        kv_tokens = sum(len(job.prompt_ids) + len(st.ids) for job, st in by_id.values())  # one request each: no sharing
        return results, GenerateStats(seconds=time.perf_counter() - t0, tokens=tokens,
                                      kv_cache_usage=self._kv_usage(kv_tokens))

    def _generate_whole(self, requests: list[GroupRequest], group_size: int
                        ) -> tuple[list[GroupResult], GenerateStats]:
        """``generate`` through ``LLM.generate``: one ``SamplingParams(n=G)`` request per group, run to the end."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(
            n=r.group_size or group_size,
            **self._sampling(r),
            logprobs=0,
            skip_special_tokens=True,
            seed=r.seed,
        ) for r in requests]
        t0 = time.perf_counter()
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests], params, use_tqdm=False,
            lora_request=self.lora_request,
        )
        seconds = time.perf_counter() - t0
        results, tokens, kv_tokens = [], 0, 0
        for req, out in zip(requests, outputs):
            if list(out.prompt_token_ids) != list(req.prompt_ids):
                raise RuntimeError(f"group {req.group_id}: the engine's prompt ({len(out.prompt_token_ids)} tokens) is "
                                   f"not the prompt training scores ({len(req.prompt_ids)} tokens)")
            ids, lps, reasons, texts = [], [], [], []
            for comp in out.outputs:
                tok = list(comp.token_ids)
                ids.append(tok)
                lps.append(torch.tensor([step[t].logprob for t, step in zip(tok, comp.logprobs)], dtype=torch.float32))
                reasons.append("length" if comp.finish_reason == "length" else "stop")
                texts.append(comp.text)
                tokens += len(tok)
            results.append(GroupResult(req.group_id, list(req.prompt_ids), ids, lps, reasons, texts,
                                       self.policy_version))
            kv_tokens += len(req.prompt_ids) + sum(map(len, ids))  # the prompt's KV is shared (prefix cache)
        # every request of the call is in flight at once: this bounds the peak
        return results, GenerateStats(seconds=seconds, tokens=tokens, kv_cache_usage=self._kv_usage(kv_tokens))

    def _sampling(self, request: GroupRequest) -> dict:
        """A request's temperature, filters, length cap and stop strings: the spec's ``rollout`` settings, or its
        ``SamplingOverride`` (top_p 1, top_k and min_p off); the cap lowered to ``request.max_tokens`` when set;
        ``rollout.stop`` either way (kept in the output: ``include_stop_str_in_output``; no keys without stop
        strings, so that requests without them are vLLM's defaults)."""
        o, r = request.sampling, self.rollout
        stops = {"stop": list(r.stop), "include_stop_str_in_output": True} if r.stop else {}
        if o is not None:
            return {"temperature": o.temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                    "max_tokens": request.length_cap(o.max_tokens), **stops}
        return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "min_p": r.min_p,
                "max_tokens": request.length_cap(r.max_response_tokens), **stops}

    def init_weight_sync(self, host, port, rank_offset, world_size, buckets, timeout_s, backend="gloo",
                         channel=None, adapter_config=None) -> list[int]:
        """Every engine worker joins the sync group (``channel``: the sender's transport descriptor, see
        ``weight_sync.transport``; None = broadcast; ``adapter_config``: the trainer's PEFT adapter config when the
        buckets hold LoRA adapters); returns their ranks."""
        from weight_sync.buckets import buckets_to_wire

        with self.server.exclusively(pause=False):
            return self.llm.collective_rpc(
                "init_weight_sync",
                args=(host, port, rank_offset, world_size, buckets_to_wire(buckets), timeout_s, backend, channel,
                      adapter_config),
            )

    def close_weight_sync(self) -> None:
        """Every engine worker leaves the sync group (before a group with new membership is formed)."""
        with self.server.exclusively(pause=False):
            self.llm.collective_rpc("close_weight_sync")

    def receive_weights(self, policy_version: int, verify: bool | list[str]) -> ReceiveReport:
        """Receive one streamed sync, reset the prefix cache, then serve ``policy_version`` (with adapter sync: its
        LoRA adapter, which every later request carries).

        Args:
            verify: checksum every tensor (True), none (False) or the named ones (``weight_sync.verify``).

        Returns:
            The first worker's version, seconds and bytes (``WeightSyncExtension.receive_weights``), with every
            worker's checksums and, with adapter sync, the modules each worker's adapter is bound to.

        Never runs while ``generate`` does (both hold the engine lock): the driver syncs between generate calls, and
        with partial rollouts an interrupted call has aborted its requests before it released the lock. Requests
        being served are paused first and continue on the new version afterwards (:mod:`rollout_workers.vllm.
        serving`).
        """
        with self.server.exclusively(pause=True):
            return self._receive_weights(policy_version, verify)

    def _receive_weights(self, policy_version: int, verify: bool | list[str]) -> ReceiveReport:
        """:meth:`receive_weights` under the engine lock."""
        try:
            reports = self.llm.collective_rpc("receive_weights", args=(policy_version, verify))
        except BaseException:
            self.policy_version = None  # some layers may hold the new weights: refuse to generate until a sync
            raise
        self.llm.reset_prefix_cache()
        first = reports[0]
        if first["lora"] is not None:
            from vllm.lora.request import LoRARequest

            self.lora_request = LoRARequest(first["lora"]["name"], first["lora"]["id"], first["lora"]["path"])
        self.policy_version = policy_version
        modules = [list(r["lora_modules"]) for r in reports] if first["lora"] is not None else None
        return ReceiveReport(policy_version=first["policy_version"], seconds=first["seconds"], bytes=first["bytes"],
                             worker_checksums=[r["checksums"] for r in reports], worker_adapter_modules=modules)
