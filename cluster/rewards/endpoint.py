"""Rewards from a service: a reward model (or any verifier) served elsewhere, called over HTTP with JSON, in batches,
with a timeout per request and a bounded number of retries with exponential backoff, over one ``httpx.Client`` per
endpoint (kept-alive connections reused from request to request; shared by the threads of a reward pool, as httpx
allows; a fresh one in a forked process).

    rm = EndpointReward("rm", "http://rm-host:8000/score", timeout_s=30, max_retries=2, batch_size=64)
    rm(prompts=["What is 2+2?"], completions=["4"], answer=["4"])    # [0.93]

The protocol (one POST per batch of at most ``batch_size`` completions)::

    POST <url>   Content-Type: application/json   (+ the configured headers)
    {"prompts": [...], "completions": [...], "<column>": [...], ...}   one entry per completion in every list
    → 200 {"rewards": [0.93, null, ...]}                              one float (or null: no score) per completion

A job names the service in its spec (``reward_endpoints: {NAME: {url: ...}}``) and weights it in
``algorithm.rewards`` like any reward function (:func:`register_endpoint` registers it under ``NAME`` when the spec
is validated). What a failure gives (``docs/own_task.md``):

- connection refused or reset, a timeout, HTTP 5xx, 408 or 429: retried up to ``max_retries`` times, waiting
  ``backoff_s``, then twice that, and so on; still failing → **UNSCORED** for the batch's completions
  (``grpo.rewards.calling.UNSCORED``: an infrastructure failure, left out of their groups and of the loss, counted in
  ``reward/infra_failed``, whatever the other rewards give those rows);
- another HTTP error (4xx: a bad request, a wrong token; a redirect, which is not followed), or a malformed reply (not
  JSON, no ``rewards`` list, the wrong count, a value that is neither a number nor null) → UNSCORED for the batch at
  once (retrying would not help); logged with the reason.

A null in the reply is the service's None: "this reward does not apply to this row" when another reward scores it
(TRL's convention), else no reward.

``timeout_s`` bounds each phase of a request (connecting, sending, each wait for the reply's bytes:
``httpx.Timeout``), as a socket timeout does. The endpoint lives here, beside the reward pools, rather than in the pure
``grpo`` package: it is a network client.

The job checks the service before anything starts (:meth:`EndpointReward.probe`: ``health_url`` answers 2xx, or an
empty batch gets ``{"rewards": []}``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import string
import threading
import time
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

import httpx

from grpo.rewards.calling import UNSCORED

__all__ = ["EndpointError", "EndpointReward", "expand_headers", "expand_url", "register_endpoint"]

logger = logging.getLogger(__name__)

#: HTTP statuses worth retrying besides 5xx: request timeout, too many requests.
_RETRY_STATUSES = frozenset({408, 429})
_ENDPOINTS: dict[str, EndpointReward] = {}  # name -> the endpoint this module registered under it


class EndpointError(RuntimeError):
    """One request failed; ``retry`` says whether another attempt may succeed."""

    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry


def _jsonable(value: Any) -> Any:
    """JSON for values the json module does not know (numpy scalars and arrays, tensors: ``tolist()``; others: str)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def expand_headers(headers: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Header values with ``${VAR}`` replaced from the environment (so a token stays out of the spec file).

    Raises:
        KeyError: a variable that is not set (its name).
    """
    env = os.environ if environ is None else environ
    return {k: string.Template(v).substitute(env) for k, v in headers.items()}


def expand_url(url: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``url`` with ``${VAR}`` replaced from the environment; None stays None.

    Raises:
        KeyError: a variable that is not set (its name).
        ValueError: the expanded URL is not http:// or https:// without whitespace (the expanded value shown).
    """
    if url is None:
        return None
    expanded = string.Template(url).substitute(os.environ if environ is None else environ)
    if not re.fullmatch(r"https?://\S+", expanded):
        raise ValueError(f"expected an http:// or https:// URL without spaces, got {expanded!r}"
                         + (f" (from {url!r})" if expanded != url else ""))
    return expanded


class EndpointReward:
    """A whole-row reward function (``fn(prompts=..., completions=..., **columns)``) answered by an HTTP service
    (protocol in the module docstring).

    Args:
        name: the reward's name (in log messages). url: where batches are POSTed.
        timeout_s: seconds one request may take. max_retries: further attempts after a retryable failure.
        backoff_s: wait before the first retry; doubled before each next one.
        batch_size: completions per request. headers: sent with every request (values already expanded).
        health_url: answers GET with 2xx when the service is up (:meth:`probe`); None: probe with an empty batch.
    """

    def __init__(self, name: str, url: str, *, timeout_s: float = 30.0, max_retries: int = 2,
                 backoff_s: float = 0.5, batch_size: int = 64, headers: Mapping[str, str] | None = None,
                 health_url: str | None = None):
        if batch_size < 1 or max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"reward endpoint {name!r}: expected batch_size >= 1, max_retries >= 0, timeout_s > 0, "
                             f"backoff_s >= 0, got {batch_size}, {max_retries}, {timeout_s}, {backoff_s}")
        self.name, self.url, self.timeout_s, self.max_retries = name, url, timeout_s, max_retries
        self.backoff_s, self.batch_size, self.health_url = backoff_s, batch_size, health_url
        self.headers = {"Content-Type": "application/json", **dict(headers or {})}
        self._client: httpx.Client | None = None
        self._client_pid = 0  # the process that made the client: a forked child makes its own
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EndpointReward({self.name!r}, {self.url!r})"

    def __getstate__(self) -> dict:
        """Pickled without its client and lock (a copy in another process opens its own connections)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_client", "_client_pid", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _client=None, _client_pid=0, _lock=threading.Lock())

    @property
    def client(self) -> httpx.Client:
        """This process's ``httpx.Client`` for the endpoint (made on first use; redirects not followed)."""
        with self._lock:
            if self._client is None or self._client_pid != os.getpid():
                self._client = httpx.Client(headers=self.headers, timeout=self.timeout_s, follow_redirects=False)
                self._client_pid = os.getpid()
            return self._client

    def close(self) -> None:
        """Close the client's connections (a later call opens new ones)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None and self._client_pid == os.getpid():
            client.close()

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], **columns: Sequence[Any]
                 ) -> list[float | None]:
        """One score (or None) per completion, ``batch_size`` completions per request."""
        out: list[float | None] = []
        for start in range(0, len(completions), self.batch_size):
            stop = min(start + self.batch_size, len(completions))
            body = {"prompts": list(prompts[start:stop]), "completions": list(completions[start:stop]),
                    **{k: list(v[start:stop]) for k, v in columns.items()}}
            out.extend(self.score_batch(body, stop - start))
        return out

    def score_batch(self, body: dict, n: int) -> list[float | None]:
        """POST one batch of ``n`` completions with retries; UNSCORED × n when it cannot be scored (module
        docstring)."""
        data = json.dumps(body, default=_jsonable).encode()
        reason = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))  # exponential backoff between attempts
            try:
                return self._parse(self._post(data, self.timeout_s), n)
            except EndpointError as exc:
                reason = str(exc)
                if not exc.retry:
                    break
        logger.warning("reward endpoint %r: %d completions not scored after %d attempt(s): %s", self.name, n,
                       attempt + 1, reason)
        return [UNSCORED] * n

    def _post(self, data: bytes, timeout_s: float) -> bytes:
        """The reply body of one POST.

        Raises:
            EndpointError: any failure, with ``retry`` set as the module docstring says.
        """
        try:
            reply = self.client.post(self.url, content=data, timeout=timeout_s)
        except httpx.TimeoutException as exc:
            raise EndpointError(f"{self.url}: {type(exc).__name__}: {exc or 'timed out'} "
                                f"(timeout_s {timeout_s:g})", True) from None
        except httpx.TransportError as exc:  # refused, reset, closed mid-reply, a protocol error
            raise EndpointError(f"cannot reach {self.url}: {exc or type(exc).__name__}", True) from None
        if not reply.is_success:
            code = reply.status_code
            retry = code >= 500 or code in _RETRY_STATUSES
            raise EndpointError(f"HTTP {code} {reply.reason_phrase} from {self.url}", retry)
        return reply.content

    def _parse(self, raw: bytes, n: int) -> list[float | None]:
        """The ``rewards`` of a reply.

        Raises:
            EndpointError: (no retry) a malformed reply, saying what was expected and what came.
        """
        try:
            reply = json.loads(raw)
        except ValueError:
            raise EndpointError(f"reply from {self.url} is not JSON: {raw[:80]!r}", False) from None
        values = reply.get("rewards") if isinstance(reply, dict) else None
        if not isinstance(values, list):
            raise EndpointError(f"reply from {self.url}: expected {{\"rewards\": [...]}}, got {str(reply)[:80]}",
                                False)
        if len(values) != n:
            raise EndpointError(f"reply from {self.url}: {len(values)} rewards for {n} completions", False)
        bad = next((v for v in values if v is not None and not isinstance(v, Real)), "ok")
        if bad != "ok":
            raise EndpointError(f"reply from {self.url}: expected numbers or null, got {bad!r}", False)
        return [None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values]

    def probe(self, timeout_s: float) -> str | None:
        """Whether the service answers now: GET ``health_url`` → 2xx, or POST an empty batch → ``{"rewards": []}``;
        one attempt of at most ``timeout_s`` seconds. None when it does, else why not."""
        if self.health_url is None:
            try:
                self._parse(self._post(json.dumps({"prompts": [], "completions": []}).encode(), timeout_s), 0)
            except EndpointError as exc:
                return f"an empty batch POSTed to it failed: {exc}"
            return None
        try:
            reply = self.client.get(self.health_url, timeout=timeout_s, follow_redirects=True)
        except httpx.HTTPError as exc:
            return f"cannot reach {self.health_url}: {exc or type(exc).__name__}"
        if not reply.is_success:
            return f"GET {self.health_url} answered HTTP {reply.status_code} {reply.reason_phrase}"
        return None


def register_endpoint(name: str, url: str, **settings: Any) -> EndpointReward:
    """Register an :class:`EndpointReward` in ``grpo.rewards.REWARD_FUNCTIONS`` under ``name``, replacing one this
    function registered there before (a process that loads the spec again).

    Raises:
        ValueError: ``name`` is a reward function registered otherwise (a builtin, a spec-named function), or a name
            the registry refuses (reserved).
    """
    from grpo.rewards import REWARD_FUNCTIONS
    from grpo.rewards.calling import where_defined

    fn = EndpointReward(name, url, **settings)
    if name in REWARD_FUNCTIONS:
        if _ENDPOINTS.get(name) is not REWARD_FUNCTIONS[name]:
            raise ValueError(f"{name!r} is already a reward function (defined at "
                             f"{where_defined(REWARD_FUNCTIONS[name])}); give the endpoint another name")
        dict.__delitem__(REWARD_FUNCTIONS, name)
    REWARD_FUNCTIONS[name] = fn
    _ENDPOINTS[name] = fn
    return fn
