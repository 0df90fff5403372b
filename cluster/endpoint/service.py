"""The agent endpoint's work, without HTTP: episodes opened and closed by the loop, and each chat-completions call
served through a :class:`contract.requests.RequestServer` (a fleet).

    service = ChatService(settings, tokenizer, fleet, chat_template)
    token = service.open("s3-g1-e2", seed=1234, max_episode_tokens=4096)      # the loop, any thread
    completion = await service.complete(token, body)                         # the HTTP layer, its event loop
    record = service.close("s3-g1-e2")                                        # the loop: an EpisodeRecord

One call: read the body (``chat_request``), plan its prompt ids (``episode.plan_prompt``: extending the previous
call token for token, or rendered afresh), cap its tokens (the call's ``max_tokens``, ``max_call_tokens``, what is
left of ``max_episode_tokens`` after the prompt), submit a :class:`TokenRequest` (the spec's sampling, the stop
strings, the seed of call k: ``settings.call_seed``) and await it (``asyncio.wrap_future``), then decode the
completion, read its tool calls (``rollout_workers.tool_parsers``), record the call (:class:`CallRecord`) and answer
a ``ChatCompletion`` (``responses``).

Refusals (:class:`Refusal`, each a one-line reason appended to the episode's ``EpisodeRecord.refused`` and logged;
the HTTP layer answers the status with an OpenAI error body): 404 for a URL of no episode or of a closed one (the
reason is appended to the record the loop already holds, so a loop that reads it later sees it), 400 for a malformed
call, a call with no room left in the episode's budget or a refused rewrite, 503 when the engine gave up on the call
(``finish_reason "abort"``, or the fleet's future raised: the call is recorded, the episode is marked failed, and its
later calls are refused). Nothing the agent sends stops the job.

Threads: ``open``/``close`` run on the loop's thread, ``complete`` on the HTTP server's event loop; a lock guards the
episode tables. The tokenizer is the service's own copy (HF fast tokenizers are not safe to share across threads).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict

from cluster.endpoint.chat_request import ChatRequest, Refusal, normal_message, normal_messages, parse_request
from cluster.endpoint.episode import OpenEpisode, plan_prompt
from cluster.endpoint.responses import assistant_message, completion
from cluster.endpoint.settings import EndpointSettings, call_seed
from cluster.loop.observation_tokens import ObservationTokens
from contract.agents import CallRecord, EpisodeRecord
from contract.requests import RequestServer, TokenRequest, TokenResult
from rollout_workers.tool_parsers import ParsedTurn, build_tool_parser

__all__ = ["ChatService"]

log = logging.getLogger("cluster.endpoint")
#: Closed episodes remembered (so that a late call's refusal reaches their record): the most recent ones.
CLOSED_KEPT = 65_536
#: Asked sampling values equal to the spec's within this are honoured.
SAME_VALUE = 1e-6


class ChatService:
    """Serves the episodes' calls (module docstring).

    Args:
        settings: the endpoint's settings. tokenizer: the model's HF tokenizer (copied). server: the fleet's
            request-level side. chat_template: ``data.chat_template``'s text, None: the tokenizer's own.

    Raises:
        ObservationTokenError: the chat template cannot delimit messages. ValueError: the tool parser cannot be built.
    """

    def __init__(self, settings: EndpointSettings, tokenizer, server: RequestServer, chat_template: str | None = None):
        self.settings, self.server = settings, server
        self.tokenizer = copy.deepcopy(tokenizer)
        self.tokens = ObservationTokens(self.tokenizer, chat_template)
        self.parser = build_tool_parser(settings.tool_parser, self.tokenizer)
        self._special = frozenset(int(i) for i in self.tokenizer.all_special_ids)
        self._lock = threading.Lock()
        self._open: dict[str, OpenEpisode] = {}  # token -> episode
        self._keys: dict[str, str] = {}  # episode key -> token
        self._closed: OrderedDict[str, EpisodeRecord] = OrderedDict()  # token -> record
        self._opened = itertools.count()

    # --- the loop's side ---------------------------------------------------------------------------------------

    def open(self, key: str, *, seed: int | None, max_episode_tokens: int, group_id: int | None = None,
             sample: int | None = None, temperature: float | None = None) -> str:
        """Start serving episode ``key``; returns its URL token (random: other episodes' URLs cannot be guessed).
        ``temperature``: the loop's temperature for its calls (held-out evaluation, 0 greedy: no filters, as a
        ``SamplingOverride``); None: the spec's sampling.

        Raises:
            ValueError: ``key`` is already open, ``max_episode_tokens`` < 2, or a negative temperature.
        """
        if max_episode_tokens < 2:
            raise ValueError(f"episode {key!r}: expected max_episode_tokens >= 2 (a prompt and one sampled token), "
                             f"got {max_episode_tokens}")
        if temperature is not None and not temperature >= 0:
            raise ValueError(f"episode {key!r}: expected a temperature >= 0 or None, got {temperature}")
        token = f"{next(self._opened)}-{secrets.token_hex(8)}"
        with self._lock:
            if key in self._keys:
                raise ValueError(f"episode {key!r} is already open at the agent endpoint")
            self._keys[key] = token
            self._open[token] = OpenEpisode(key, token, seed, max_episode_tokens, group_id, sample, temperature)
        return token

    def close(self, key: str) -> EpisodeRecord:
        """Stop serving episode ``key`` and return its record (later calls are refused).

        Raises:
            KeyError: no open episode ``key``.
        """
        with self._lock:
            if key not in self._keys:
                raise KeyError(f"episode {key!r} is not open at the agent endpoint")
            token = self._keys.pop(key)
            episode = self._open.pop(token)
            episode.closed = True
            self._closed[token] = episode.record
            while len(self._closed) > CLOSED_KEPT:
                self._closed.popitem(last=False)
        return episode.record

    def open_episodes(self) -> int:
        with self._lock:
            return len(self._open)

    # --- the HTTP side ------------------------------------------------------------------------------------------

    def _episode(self, token: str) -> OpenEpisode:
        with self._lock:
            episode = self._open.get(token)
            if episode is not None:
                return episode
            record = self._closed.get(token)
        if record is None:
            raise Refusal(404, "no episode is served at this URL (an episode's URL is valid from open to close)",
                          "unknown_episode")
        self._refuse(record, "a call after the episode closed (the agent returned, or its time ran out)")
        raise Refusal(404, f"episode {record.episode_key!r} has ended: the endpoint serves an episode's calls "
                      f"until the agent returns", "episode_closed")

    @staticmethod
    def _refuse(record: EpisodeRecord, reason: str) -> None:
        record.refused.append(reason)
        log.warning("agent endpoint: episode %r: refused %s", record.episode_key, reason)

    def model_name(self) -> str:
        return self.settings.model_name

    def check_url(self, token: str) -> None:
        """Refuse (404) a URL of no open episode (``GET /models``)."""
        self._episode(token)

    async def complete(self, token: str, body) -> tuple[dict, CallRecord]:
        """Serve one chat-completions call of the episode at ``token``; its ``ChatCompletion`` as a JSON-ready dict
        and the call's record (already in the episode's).

        Raises:
            Refusal: module docstring; its reason is in the episode's record.
        """
        started = time.perf_counter()
        episode = self._episode(token)
        try:
            request = parse_request(body)
            async with episode.lock:
                return await self._serve(episode, request, started)
        except Refusal as refusal:
            self._refuse(episode.record, f"call {episode.calls + 1}: {refusal.reason}")
            raise

    async def _serve(self, episode: OpenEpisode, request: ChatRequest, started: float) -> tuple[dict, CallRecord]:
        if episode.closed:
            raise Refusal(404, f"episode {episode.key!r} has ended while the call waited for the episode's previous "
                          f"one", "episode_closed")
        if episode.failed:
            raise Refusal(400, f"the episode cannot continue: {episode.failed}", "episode_failed")
        messages = normal_messages(request.messages)
        tools = request.tools or None
        prompt_ids, extends = plan_prompt(episode, messages, tools, self.tokens, self.settings.rewritten_history)
        room = episode.max_episode_tokens - len(prompt_ids)
        if room < 1:
            raise Refusal(400, f"over the episode's token budget: the prompt has {len(prompt_ids)} tokens and the "
                          f"episode may hold {episode.max_episode_tokens} (prompt and completion)", "token_budget")
        k = episode.calls + 1  # counted once served (a refused call takes no number, so no later call's seed)
        token_request, sampling = self._token_request(episode, request, prompt_ids, room, k)
        waited = time.perf_counter()
        result = await self._sample(episode, token_request, extends, k)
        waited = time.perf_counter() - waited
        text, turn = self._read(result, request)
        finish = "tool_calls" if turn.calls else result.finish_reason
        message = assistant_message(turn, k)
        with_texts = [self.tokenizer.decode([i]) for i in result.token_ids] if request.logprobs else None
        answer = completion(completion_id=f"chatcmpl-{episode.token}-{k}", model=self.settings.model_name,
                            message=message, finish_reason=finish, prompt_ids=prompt_ids, token_ids=result.token_ids,
                            logprobs=result.logprobs, versions=result.token_versions, token_texts=with_texts,
                            extends=extends, tokens_left=room - len(result.token_ids), sampling=sampling,
                            return_prompt_ids=bool(request.return_token_ids)).model_dump(exclude_none=True)
        returned = normal_message(answer["choices"][0]["message"])
        episode.remember(messages, tools, returned, text)
        seconds = time.perf_counter() - started
        call = CallRecord(list(prompt_ids), list(result.token_ids), list(result.logprobs), list(result.token_versions),
                          finish, extends, tool_calls=len(turn.calls), seconds=seconds, engine_s=result.engine_s,
                          queue_s=result.queue_s, endpoint_s=seconds - waited)
        episode.record.calls.append(call)
        episode.calls = k
        return answer, call

    def _token_request(self, episode: OpenEpisode, request: ChatRequest, prompt_ids: list[int], room: int,
                       k: int) -> tuple[TokenRequest, dict]:
        """The engine request of call ``k``, and the ``sampling`` the response reports (module docstring of
        ``chat_request``: what is honoured)."""
        s = self.settings
        asked = request.asked_max_tokens
        max_tokens = min(room, s.max_call_tokens, asked if asked is not None else room)
        stop = tuple(dict.fromkeys((*s.stop, *request.stop_strings)))
        applied = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p}
        source = "rollout.{}"
        if episode.temperature is not None:  # the loop's (held-out evaluation): no filters, as a SamplingOverride
            applied = {"temperature": episode.temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
            source = "the episode's {}"
        notes = []
        for name, value in (("temperature", request.temperature), ("top_p", request.top_p),
                            ("top_k", request.top_k), ("min_p", request.min_p)):
            if value is not None and abs(value - applied[name]) > SAME_VALUE:
                notes.append(f"{name} {value} asked, sampled at {source.format(name)} {applied[name]}: the trainer "
                             f"scores tokens under the spec's distribution")
        if request.seed is not None:
            notes.append("seed is set by the endpoint (the episode's seed and the call's number)")
        seed = call_seed(episode.seed, k)
        token_request = TokenRequest(request_id=f"{episode.key}-c{k}", prompt_ids=tuple(prompt_ids),
                                     max_tokens=max_tokens, **applied, stop=stop, seed=seed,
                                     group_id=episode.group_id, sample=episode.sample)
        sampling = {**applied, "max_tokens": max_tokens, "seed": seed, "stop": list(stop), "notes": notes}
        return token_request, sampling

    async def _sample(self, episode: OpenEpisode, request: TokenRequest, extends: bool, k: int) -> TokenResult:
        """The engine's result for call ``k``; an engine that gave up fails the episode (module docstring)."""
        try:
            result = await asyncio.wrap_future(self.server.submit(request))
        except Exception as exc:  # the fleet gave up on a lost engine: an infrastructure failure of the episode
            episode.failed = f"call {k}: the engine failed ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
            raise Refusal(503, episode.failed, "engine_failed") from None
        if episode.closed:
            raise Refusal(404, f"episode {episode.key!r} ended while call {k} was sampled; its tokens were dropped",
                          "episode_closed")
        if result.finish_reason == "abort":
            episode.record.calls.append(CallRecord(list(request.prompt_ids), list(result.token_ids),
                                                   list(result.logprobs), list(result.token_versions), "abort",
                                                   extends, engine_s=result.engine_s, queue_s=result.queue_s))
            episode.failed = f"call {k}: the engine gave up on the request (finish_reason abort)"
            raise Refusal(503, episode.failed, "engine_abort")
        return result

    def _read(self, result: TokenResult, request: ChatRequest) -> tuple[str, ParsedTurn]:
        """The completion's text (special tokens kept but the trailing end-of-turn ones, e.g. ``<|im_end|>``) and
        its content and tool calls; without tool calls a matched stop string is left out of the content (OpenAI's
        convention; it stays in the tokens)."""
        ids = list(result.token_ids)
        while ids and ids[-1] in self._special:
            ids.pop()
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        turn = self.parser.parse(text, request.tools) if request.parses_tools else ParsedTurn(text or None)
        stop = result.stop_reason
        if not turn.calls and stop and text.endswith(stop):
            turn = ParsedTurn(text[:-len(stop)] or None)
        return text, turn
