"""What the agent endpoint takes from the job spec, as one plain object (the service never reads the spec itself), and
the two small rules derived from it: each call's seed, and the host put in the episodes' URLs."""

from __future__ import annotations

import ipaddress
import socket
import zlib
from dataclasses import dataclass

__all__ = ["EndpointSettings", "advertised_host", "call_seed", "node_ip"]


@dataclass(frozen=True)
class EndpointSettings:
    """The endpoint's settings (``rollout.endpoint`` and the sampling the trainer assumes).

    Attributes:
        temperature, top_p, top_k, min_p: the distribution every call is sampled from (``rollout.*``: what
            ``grpo.logprobs`` scores the tokens with).
        max_call_tokens: tokens one call may sample (``rollout.endpoint.max_call_tokens`` or
            ``rollout.max_response_tokens``).
        stop: stop strings every call gets (``rollout.stop``).
        tool_parser: ``rollout.endpoint.tool_parser``. rewritten_history: ``"split"`` or ``"refuse"``.
        host, port, advertise_host: where it listens and the host in its URLs (``rollout.endpoint.*``).
        model_name: the id ``GET /models`` lists and responses carry (``model.path``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_call_tokens: int = 256
    stop: tuple[str, ...] = ()
    tool_parser: str = "hermes"
    rewritten_history: str = "split"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    model_name: str = "policy"

    @classmethod
    def from_spec(cls, spec) -> EndpointSettings:
        """The settings of a validated ``JobSpec``."""
        r, e = spec.rollout, spec.rollout.endpoint
        return cls(temperature=float(r.temperature), top_p=float(r.top_p), top_k=int(r.top_k), min_p=float(r.min_p),
                   max_call_tokens=int(e.max_call_tokens or r.max_response_tokens),
                   stop=tuple(getattr(r, "stop", None) or ()), tool_parser=e.tool_parser,
                   rewritten_history=e.rewritten_history, host=e.host, port=e.port, advertise_host=e.advertise_host,
                   model_name=spec.model.path)


def call_seed(seed: int | None, call: int) -> int | None:
    """The sampling seed of call ``call`` (1-based) of an episode seeded ``seed``: the episode's seed for its first
    call (a one-call episode is the completion that seed gives a single-turn rollout), then a CRC-32 mix of (seed,
    call) in [0, 2**31), as ``cluster.loop.episode_state.turn_seed`` mixes turns; None when unseeded."""
    if seed is None:
        return None
    if call == 1:
        return seed
    return zlib.crc32(f"{seed}:call{call}".encode()) & 0x7FFFFFFF


def node_ip() -> str:
    """This machine's IP on its route to the network: the source address a UDP socket "connected" to a public
    address gets (nothing is sent), as Ray's ``get_node_ip_address`` finds it; the host name's address when there
    is no route, and 127.0.0.1 as the last resort."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 80))
            return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host put in the episodes' URLs: ``advertise_host`` when set; this node's IP (:func:`node_ip`) when
    ``host`` binds every interface; else ``host`` (an IPv6 address in brackets)."""
    if advertise_host:
        chosen = advertise_host
    else:
        try:
            chosen = node_ip() if ipaddress.ip_address(host).is_unspecified else host
        except ValueError:
            chosen = host
    return f"[{chosen}]" if ":" in chosen and not chosen.startswith("[") else chosen
