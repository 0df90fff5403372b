"""The ``rollout.endpoint`` section: the chat-completions endpoint agents (``rollout.agent``) talk to.

Imports only pydantic and :mod:`cluster.spec` modules; the tool-parser registry (``rollout_workers.tool_parsers``)
is imported when a spec is validated, as the variant registries are (:mod:`cluster.spec.variants`).
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from cluster.spec.fields import MAX_SEQUENCE_TOKENS, SPEC_CONFIG

__all__ = ["EndpointSpec"]


class EndpointSpec(BaseModel):
    """The OpenAI-compatible chat-completions endpoint the driver serves to agents (cluster.endpoint,
    docs/agent_endpoint.md): one base URL per episode; every call's prompt ids, sampled ids, behaviour logprobs and
    policy versions are recorded and the training sequences are built from them token for token."""

    model_config = SPEC_CONFIG
    host: str = Field("127.0.0.1", min_length=1, description=(
        "Address the endpoint binds in the driver's process. 127.0.0.1 (default): agents on the driver's machine "
        "only. On a multi-node Ray cluster whose agent workers run on other nodes: 0.0.0.0 (every interface) or the "
        "driver node's IP; agents are then given advertise_host. Each episode's URL holds a random token, so other "
        "episodes' URLs cannot be guessed."))
    port: int = Field(0, ge=0, le=65535, strict=True, description=(
        "TCP port of the endpoint; 0 (default): a free port chosen when it starts."))
    advertise_host: str | None = Field(None, min_length=1, description=(
        "Host name or IP put in the episodes' base URLs; null: host, or the driver node's IP (the address of its "
        "route to the network) when host is 0.0.0.0 or ::."))
    tool_parser: str = Field("hermes", min_length=1, description=(
        "How tool calls are read from the model's text (rollout_workers.tool_parsers): 'hermes' (built in: "
        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, SmolLM2's and Qwen's format), 'vllm:<name>' "
        "(vLLM's own parser of that name, e.g. vllm:hermes, vllm:llama3_json, vllm:mistral; needs vLLM installed), "
        "or a name registered with @register_tool_parser(\"NAME\") in a module imported before the spec is "
        "validated."))
    max_call_tokens: int | None = Field(None, ge=1, le=MAX_SEQUENCE_TOKENS, strict=True, description=(
        "Tokens one call may sample at most (a call's max_tokens is lowered to it, and to what is left of the "
        "episode's budget); null: rollout.max_response_tokens."))
    rewritten_history: Literal["split", "refuse"] = Field("split", description=(
        "A call whose messages do not extend the episode's previous call (the agent summarised, dropped or edited "
        "earlier turns, or started over): 'split' (default) renders its messages afresh and starts a new training "
        "sequence there, which shares the episode's advantage (as verl and SkyRL do); 'refuse' answers HTTP 400 and "
        "records the reason, so an episode is always one sequence."))

    @field_validator("host", "advertise_host")
    @classmethod
    def _no_scheme(cls, value: str | None) -> str | None:
        if value is not None and ("/" in value or " " in value):
            raise ValueError(f"expected a host name or IP address (no scheme, path or spaces), got {value!r}")
        return value

    @field_validator("tool_parser")
    @classmethod
    def _registered_parser(cls, name: str) -> str:
        from rollout_workers.tool_parsers import check_tool_parser

        problem = check_tool_parser(name)
        if problem is not None:
            raise ValueError(problem)
        return name

    @property
    def wildcard(self) -> bool:
        """Whether ``host`` binds every interface (0.0.0.0, ::)."""
        try:
            return ipaddress.ip_address(self.host).is_unspecified
        except ValueError:
            return False

