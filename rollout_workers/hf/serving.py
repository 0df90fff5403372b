"""Request-level serving on the ``hf`` engine: a batching thread over its model.

The thread takes every request waiting (up to the engine's ``max_batch_rows``) and decodes them as one batch
(:func:`rollout_workers.hf.sampling.sample_rows`: the same seeds, filters, logprobs and stop strings as ``generate``);
requests that arrive meanwhile wait for that batch only, never for other requests' whole episodes (an episode submits
its next turn as a new request). No continuous batching: a batch runs until its last row ends.

Pauses: ``generate`` and the weight sync take the engine :meth:`HFServer.exclusively`: the running batch stops at its
next token step (its rows keep their tokens) and its unfinished requests are queued ahead of the others; once the
engine is released each continues as a new segment on the engine's weights then (``rollout_workers.serving``: every
token stamped with the version that sampled it).
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import contextmanager

from contract.requests import TokenRequest, TokenResult
from rollout_workers.hf.sampling import RowJob, Sampling, sample_rows
from rollout_workers.serving import BusyClock, RequestQueue, ServedRequest, ServingThread

__all__ = ["HFServer"]


class HFServer:
    """The request-level side of one :class:`rollout_workers.hf.engine.HFEngine` (module docstring).

    Args:
        engine: the engine (its ``model``, ``_lock``, ``policy_version``, ``eos_ids``, ``decode``,
            ``max_batch_rows``, ``unseeded_seed``).
        name: how results name the engine (``TokenResult.engine``).

    Attributes:
        busy: the engine's busy clock (time serving requests).
    """

    def __init__(self, engine, name: str = "engine"):
        self.engine, self.name = engine, name
        self.queue = RequestQueue()
        self.busy = BusyClock()
        self.thread = ServingThread(self._serve, "hf-request-serving", self.queue)

    def submit(self, request: TokenRequest) -> Future[TokenResult]:
        """Queue ``request``; the future resolves when it ends (thread-safe). A request no engine can serve fails
        its future with ValueError (``rollout_workers.serving.check_request``)."""
        return self.thread.submit(request)

    @contextmanager
    def exclusively(self):
        """The engine to the calling thread alone, under its lock: a running batch stops at its next token step and
        its unfinished requests are queued to continue afterwards (module docstring)."""
        with self.queue.hold(), self.engine._lock:
            yield

    def close(self) -> None:
        """Stop the batching thread; requests not finished end with finish reason ``"abort"`` and their tokens."""
        waiting = self.queue.close()
        self.thread.join()
        for state in waiting + self.queue.take():
            state.finish("abort")
            if not state.future.done():
                state.future.set_result(state.result(self.name, self.busy.seconds))

    def _serve(self) -> None:
        """Decode batches of the waiting requests while there are any (and no hold)."""
        ready = lambda: self.engine.policy_version is not None  # noqa: E731 - after a failed sync: wait for one
        while self.queue.wait_for_work(lambda: False, ready):
            with self.engine._lock:
                if self.queue.held:
                    continue  # another thread is about to take the engine: let it
                states = self.queue.take(self.engine.max_batch_rows)
                with self.busy.running():
                    self._run_batch(states)

    def _run_batch(self, states: list[ServedRequest]) -> None:
        """One decode batch of ``states``' next segments; finished ones resolve, stopped ones are queued again."""
        engine, version = self.engine, self.engine.policy_version
        jobs = []
        for state in states:
            prompt, max_tokens, seed = state.next_segment()
            r = state.request
            sampling = Sampling(temperature=float(r.temperature), max_tokens=0, top_k=int(r.top_k),
                                top_p=float(r.top_p), min_p=float(r.min_p), stop=tuple(r.stop))
            jobs.append(RowJob(prompt, max_tokens, seed if seed is not None else engine.unseeded_seed(), sampling,
                               len(state.ids)))
        try:
            rows = sample_rows(engine.model, jobs, engine.eos_ids, lambda: self.queue.held, engine.max_batch_rows,
                               engine.decode)
        except Exception as exc:  # noqa: BLE001 - the batch's requests fail with the model's error
            for state in states:
                state.future.set_exception(exc)
            return
        paused = []
        for state, row in zip(states, rows):
            state.add(row.ids, row.logprobs, version, row.text if row.stop_reason is not None else
                      engine.decode(row.ids))
            if row.finish_reason is None:
                paused.append(state)  # stopped by a hold: continues after it
                continue
            state.finish(row.finish_reason, row.stop_reason)
            state.future.set_result(state.result(self.name, self.busy.seconds))
        self.queue.put_front(paused)
