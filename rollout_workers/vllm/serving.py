"""Request-level serving on the vLLM engine: one thread steps vLLM's ``LLMEngine`` (V1) and adds requests between
steps, so requests are served as they arrive, continuously batched by vLLM's scheduler.

Why a stepping thread over the engine the ``LLM`` already holds, rather than vLLM's ``AsyncLLM``: the same engine
serves both ``generate`` (``LLM.generate``: single-turn groups keep exactly the numerics and seeds they have — the
same engine core, the same request construction, one ``n=G`` request per group) and requests; the weight sync stays
what it is (``collective_rpc`` into the worker extension, under the engine lock); and every call into the engine is
made by one thread at a time (vLLM's sync engine client is not thread-safe), which the engine lock and the serving
thread's holds guarantee. vLLM's engine core runs in its own process and schedules whatever requests it holds at each
step, so requests added between steps join the running batch (continuous batching).

Pauses: ``generate`` and ``receive_weights`` take the engine :meth:`VLLMServer.exclusively`: the serving thread
finishes its step and waits; every running request is aborted through vLLM (``abort_request``), keeping its tokens,
and queued ahead of the others; once the engine is released, each continues as a new request on the engine's weights
then (``rollout_workers.serving``). ``init_weight_sync``/``close_weight_sync`` only hold the thread off (nothing of
the model changes).
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

from contract.requests import TokenRequest, TokenResult
from rollout_workers.serving import BusyClock, RequestQueue, ServedRequest, ServingThread
from rollout_workers.stops import StopScanner

__all__ = ["VLLMServer"]


@dataclass
class _Segment:
    """One engine request of a served request: its state, the stop scanner of a continued segment (None for a first
    one: vLLM checks its stop strings itself) and the length of the state's text when the segment started."""

    state: ServedRequest
    scanner: StopScanner | None
    text_start: int


class VLLMServer:
    """The request-level side of one :class:`rollout_workers.vllm.engine.VLLMEngine` (module docstring).

    Args:
        engine: the engine (its ``llm``, ``_engine_lock``, ``policy_version``, ``lora_request``, ``request_params``).
        name: how results name the engine (``TokenResult.engine``).

    Attributes:
        busy: the engine's busy clock (time serving requests).
    """

    def __init__(self, engine, name: str = "engine-0"):
        self.engine, self.name = engine, name
        self.queue = RequestQueue()
        self.busy = BusyClock()
        self._running: dict[str, _Segment] = {}  # vLLM request id → its segment
        self._ids = itertools.count()
        self.thread = ServingThread(self._serve, "vllm-request-serving", self.queue)

    # ---- the caller's side ----------------------------------------------------------------------------------------
    def submit(self, request: TokenRequest) -> Future[TokenResult]:
        """Queue ``request``; the future resolves when it ends (thread-safe). A request no engine can serve fails
        its future with ValueError (``rollout_workers.serving.check_request``); so does one vLLM refuses (a prompt
        longer than the engine's context)."""
        return self.thread.submit(request)

    @contextmanager
    def exclusively(self, pause: bool):
        """The engine to the calling thread alone, under the engine lock: the serving thread is held off; with
        ``pause``, every running request is aborted (keeping its tokens) and queued to continue afterwards."""
        with self.queue.hold(), self.engine._engine_lock:
            if pause and self._running:
                self._pause_running()
            yield

    def close(self) -> None:
        """Stop the serving thread; requests not finished end with finish reason ``"abort"`` and their tokens."""
        waiting = self.queue.close()
        self.thread.join()
        states = waiting + [segment.state for segment in self._running.values()]
        self._running.clear()
        for state in states:
            state.finish("abort")
            if not state.future.done():
                state.future.set_result(state.result(self.name, self.busy.seconds))

    # ---- the serving thread ---------------------------------------------------------------------------------------
    def _serve(self) -> None:
        """Admit waiting requests and step the engine while any runs; wait otherwise (or while held)."""
        ready = lambda: self.engine.policy_version is not None  # noqa: E731 - after a failed sync: wait for one
        while self.queue.wait_for_work(lambda: bool(self._running), ready):
            with self.engine._engine_lock:
                if self.queue.held:
                    continue  # another thread is about to take the engine: let it
                self._admit(self.queue.take())
                if self._running:
                    with self.busy.running():
                        outputs = self.engine.llm.llm_engine.step()
                    self._take(outputs)

    def _admit(self, states: list[ServedRequest]) -> None:
        """Add each state's next segment to vLLM (``VLLMEngine.request_params``); a request vLLM refuses fails."""
        from vllm.inputs import TokensPrompt

        llm_engine = self.engine.llm.llm_engine
        decode = self._decode()
        for state in states:
            prompt, max_tokens, seed = state.next_segment()
            rid = f"serve-{next(self._ids)}"
            try:
                params = self.engine.request_params(state.request, max_tokens, seed)
                llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params,
                                       lora_request=self.engine.lora_request)
            except Exception as exc:  # noqa: BLE001 - the request's own fault (too long, bad parameters)
                state.future.set_exception(exc)
                continue
            self._running[rid] = _Segment(state, state.scanner(decode), len(state.text))

    def _take(self, outputs) -> None:
        """Append each output's new tokens (DELTA outputs) at the engine's version; resolve finished requests."""
        version = self.engine.policy_version
        for out in outputs:
            segment = self._running.get(out.request_id)
            if segment is None:
                continue
            state, scanner = segment.state, segment.scanner
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            logprobs = [step[t].logprob for t, step in zip(tokens, comp.logprobs or [])]
            hit = next((i for i, t in enumerate(tokens) if scanner.add(t)), None) if scanner is not None else None
            if hit is not None:  # a stop string begun before a pause, completed now
                state.add(tokens[:hit + 1], logprobs[:hit + 1], version, "")
                state.text = state.text[:segment.text_start] + scanner.text
                state.finish("stop", scanner.stop_reason)
                if not out.finished:
                    self.engine.llm.llm_engine.abort_request([out.request_id])
            else:
                state.add(tokens, logprobs, version, comp.text)
                if out.finished:
                    state.finish("length" if comp.finish_reason == "length" else "stop",
                                 comp.stop_reason if isinstance(comp.stop_reason, str) else None)
            if state.finish_reason is not None:
                del self._running[out.request_id]
                state.future.set_result(state.result(self.name, self.busy.seconds))

    def _pause_running(self) -> None:
        """Abort every running request in vLLM (its tokens kept) and queue it ahead of the others."""
        self.engine.llm.llm_engine.abort_request(list(self._running))
        paused = [segment.state for segment in self._running.values()]
        self._running.clear()
        self.queue.put_front(paused)

    def _decode(self):
        tokenizer = self.engine.llm.get_tokenizer()
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
