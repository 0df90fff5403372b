"""A job's agent endpoint as both runtimes build it (``cluster.in_process.local_job``,
``cluster.ray_shell.runtime.build_job``): one line each, ``agent_endpoint=job_endpoint(spec, fleet)``.

The endpoint is built when the job starts it (``GRPOJob.start`` starts its parts after the fleet): the model's
tokenizer is loaded then, after the job has checked ``model.path`` itself, so building a job (``grpo-cluster
validate``, a dry run) costs nothing more and reports a bad model the job's way. The endpoint serves in the driver's
process and samples through the fleet's request-level side (``contract.requests.RequestServer``); a fleet without
one gets no endpoint (the job then refuses an agent spec, naming what is missing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from contract.agents import EpisodeRecord
from contract.requests import RequestServer

if TYPE_CHECKING:
    from cluster.endpoint.server import ChatEndpoint

__all__ = ["JobEndpoint", "job_endpoint"]


class JobEndpoint:
    """The job's :class:`ChatEndpoint`, built at :meth:`start` (module docstring); a
    :class:`contract.agents.AgentEndpoint`.

    Args:
        spec: the validated job spec. server: the fleet's request-level side.
    """

    def __init__(self, spec, server: RequestServer):
        self.spec, self.server = spec, server
        self.endpoint: ChatEndpoint | None = None

    def start(self) -> None:
        """Build the endpoint (once: the tokenizer, the chat template, the tool parser) and serve.

        Raises:
            ModelError: the tokenizer cannot be loaded (naming ``model.path``). ObservationTokenError: the chat
                template cannot delimit messages. ValueError: the tool parser does not fit the model. OSError: the
                address cannot be bound (naming ``rollout.endpoint.host``/``port``).
        """
        if self.endpoint is None:
            from cluster.data.models import resolve_model_path
            from cluster.endpoint.server import ChatEndpoint
            from cluster.loop.setup import load_tokenizer
            from contract.model_source import ModelSource

            model = self.spec.model
            tokenizer = load_tokenizer(resolve_model_path(model.path, model.cache_dir), ModelSource.of(model))
            self.endpoint = ChatEndpoint.from_spec(self.spec, tokenizer, self.server)
        self.endpoint.start()

    def _started(self) -> ChatEndpoint:
        if self.endpoint is None:
            raise RuntimeError("the agent endpoint is not started (the job starts it with its fleet)")
        return self.endpoint

    def open_episode(self, episode_key: str, *, seed: int | None, max_episode_tokens: int,
                     group_id: int | None = None, sample: int | None = None,
                     temperature: float | None = None) -> str:
        """``ChatEndpoint.open_episode``. Raises RuntimeError before :meth:`start`."""
        return self._started().open_episode(episode_key, seed=seed, max_episode_tokens=max_episode_tokens,
                                            group_id=group_id, sample=sample, temperature=temperature)

    def close_episode(self, episode_key: str) -> EpisodeRecord:
        """``ChatEndpoint.close_episode``. Raises RuntimeError before :meth:`start`."""
        return self._started().close_episode(episode_key)

    def describe(self) -> str:
        return self.endpoint.describe() if self.endpoint is not None else "agent endpoint (not started)"

    def shutdown(self) -> None:
        """Stop serving (idempotent; :meth:`start` serves again)."""
        if self.endpoint is not None:
            self.endpoint.shutdown()


def job_endpoint(spec, fleet) -> JobEndpoint | None:
    """The job's agent endpoint: a :class:`JobEndpoint` when the spec runs episodes on the agent pool
    (``rollout.agent``, or ``rollout.multi_turn.runner: agent_pool``) and ``fleet`` serves requests; else None."""
    from cluster.spec.agents import uses_agent_pool

    if not uses_agent_pool(spec.rollout) or not isinstance(fleet, RequestServer):
        return None
    return JobEndpoint(spec, fleet)
