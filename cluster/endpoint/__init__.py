"""The agent endpoint: an OpenAI-compatible chat-completions service, one base URL per episode, that agents
(``rollout.agent``) talk to through the ``openai`` client; it samples through the fleet's request-level side
(``contract.requests.RequestServer``) and records every call token for token (``contract.agents.EpisodeRecord``).

Runtime-neutral: both runtimes start it in the driver's process (:class:`ChatEndpoint`). Modules: ``server`` (HTTP:
FastAPI on uvicorn, a background thread), ``service`` (one call's work), ``episode`` (an open episode and its next
prompt's ids), ``chat_request`` (what a call may ask), ``responses`` (OpenAI's types), ``settings`` (from the spec),
``job`` (``job_endpoint``: the endpoint both runtimes give a job with agents).
The training sequences are built from the records by ``cluster.loop.agent_sequences``.

The package imports FastAPI, uvicorn and the ``openai`` types only when one of its names is first used (``job``,
which both runtimes import, needs none of them until a job with agents starts).
"""

from __future__ import annotations

import importlib

__all__ = ["ChatEndpoint", "ChatService", "EndpointSettings", "make_app"]
_WHERE = {"ChatEndpoint": "server", "make_app": "server", "ChatService": "service", "EndpointSettings": "settings"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'cluster.endpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"cluster.endpoint.{_WHERE[name]}"), name)
