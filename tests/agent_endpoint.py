"""A stand-in for the rollout side's chat-completions endpoint (``contract.agents.AgentEndpoint``), for tests of
agents, their pool and the loop: a FastAPI app served by uvicorn in a thread, one base URL per episode, that the real
``openai`` client talks to.

    endpoint = StandInEndpoint(tokenizer, sampler)       # sampler(prompt_ids, max_tokens, seed, temperature)
    endpoint.start()
    url = endpoint.open_episode("e1", seed=7, max_episode_tokens=512, sample=0)
    ...                                                  # openai.AsyncOpenAI(base_url=url).chat.completions.create
    record = endpoint.close_episode("e1")                # its CallRecords
    endpoint.shutdown()

What it does, as the real endpoint is expected to:

- renders a call's messages with the chat template (generation prompt, ``add_special_tokens=False``); a call whose
  messages are the previous call's plus its reply plus one new message extends the previous call's tokens with that
  message's tokens as the lock-step runner makes them (``cluster.loop.observation_tokens``), never re-rendered;
- seeds call k of an episode seeded s as the endpoint does (:func:`call_seed`: s for the first call, then a CRC-32
  mix of (s, k)), or with the lock-step runner's seeds (:func:`lock_step_seed`, for comparisons with it);
- caps a call's completion at ``max_tokens``, ``max_call_tokens`` and what is left of the episode's budget; refuses a
  call with no room left (HTTP 400, code ``token_budget``) and a call for an episode that is not open (HTTP
  404), each with a one-line reason (``refused``, ``late_calls``);
- answers in the OpenAI chat-completion format plus the sampled ``token_ids`` (vLLM's ``return_token_ids`` field).

Samplers: :func:`scripted_sampler` (fixed texts, tokenised; logprob -1 each) and :func:`fleet_sampler` (one
request of one completion to an in-process ``LocalFleet``: real logprobs and versions).
"""

from __future__ import annotations

import socket
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cluster.loop.episode_state import turn_seed
from cluster.loop.observation_tokens import ObservationTokens
from contract.agents import TOKEN_BUDGET_ERROR, CallRecord, EpisodeRecord

#: sampler(prompt_ids, max_tokens, seed, temperature) -> (token ids, logprobs, versions, finish reason)
Sampler = Callable[[list[int], int, int | None, float | None], tuple[list[int], list[float], list[int], str]]


def call_seed(seed: int | None, sample: int, call: int) -> int | None:
    """The endpoint's seed of call ``call`` (1-based) of an episode opened with ``seed`` (its settings'
    ``call_seed``): the seed itself, then a CRC-32 mix of (seed, call)."""
    if seed is None or call == 1:
        return seed
    return zlib.crc32(f"{seed}:call{call}".encode()) & 0x7FFFFFFF


def lock_step_seed(seed: int | None, sample: int, call: int) -> int | None:
    """The lock-step runner's seed of turn ``call`` of episode ``sample`` (``cluster.loop.episode_state.turn_seed``),
    for an episode opened with the loop's seed (its group's seed + ``sample``)."""
    return None if seed is None else turn_seed(seed - sample, sample, call)


@dataclass
class _Episode:
    seed: int | None
    budget: int
    sample: int
    temperature: float | None
    record: EpisodeRecord
    messages: list[dict] = field(default_factory=list)  # the last call's messages + its reply


def scripted_sampler(tokenizer, texts: Sequence[str], eos: bool = True) -> Sampler:
    """Answers call n (over all episodes, in order) with ``texts[n % len(texts)]`` (cut at the cap), EOS appended
    when ``eos``; logprob -1.0 and version 0 for every token."""
    count = iter(range(10**9))

    def sample(prompt_ids, max_tokens, seed, temperature):
        text = texts[next(count) % len(texts)]
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos:
            ids.append(tokenizer.eos_token_id)
        ids = ids[:max_tokens]
        reason = "stop" if eos and ids and ids[-1] == tokenizer.eos_token_id else "length"
        return ids, [-1.0] * len(ids), [0] * len(ids), reason

    return sample


def fleet_sampler(fleet) -> Sampler:
    """One request of one completion to ``fleet`` (a started ``LocalFleet``) per call, serialised."""
    from contract.messages import GroupRequest, SamplingOverride

    lock = threading.Lock()

    def sample(prompt_ids, max_tokens, seed, temperature):
        sampling = None if temperature is None else SamplingOverride(temperature=temperature, max_tokens=max_tokens)
        request = GroupRequest(group_id=0, prompt_ids=list(prompt_ids), group_size=1, seed=seed, sampling=sampling,
                               max_tokens=max_tokens)
        with lock:
            result = fleet.generate([request], record=False)[0]
        ids = list(result.response_ids[0])
        return ids, [float(x) for x in result.behaviour_logprobs[0]], result.versions_of(0), result.finish_reasons[0]

    return sample


class StandInEndpoint:
    """The stand-in endpoint (module docstring).

    Args:
        tokenizer: the model's tokenizer. sampler: how a call's completion is sampled.
        chat_template: ``data.chat_template`` text, None: the tokenizer's. max_call_tokens: the spec's
            ``rollout.max_response_tokens``. seeds: ``seeds(episode seed, sample, call)``, a call's seed.
    """

    def __init__(self, tokenizer, sampler: Sampler, chat_template: str | None = None, max_call_tokens: int = 256,
                 seeds: Callable[[int | None, int, int], int | None] = call_seed):
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.chat_template = chat_template
        self.seeds = seeds
        self.max_call_tokens = max_call_tokens
        self.observations = ObservationTokens(tokenizer, chat_template)
        self.episodes: dict[str, _Episode] = {}
        self.late_calls: list[str] = []
        self.closed: dict[str, EpisodeRecord] = {}  # every record handed back, by episode key
        self.opened: list[dict] = []
        self._lock = threading.Lock()
        self._server = self._thread = None
        self.port = None

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._server is not None:
            return
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="error")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stand-in endpoint did not start")
            time.sleep(0.02)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    # ---- the protocol ---------------------------------------------------------------------------------------------
    def open_episode(self, episode_key, *, seed, max_episode_tokens, group_id=None, sample=None, temperature=None):
        with self._lock:
            self.episodes[episode_key] = _Episode(seed, max_episode_tokens, sample or 0, temperature,
                                                  EpisodeRecord(episode_key))
            self.opened.append({"key": episode_key, "seed": seed, "budget": max_episode_tokens, "sample": sample,
                                "group_id": group_id, "temperature": temperature})
        return f"http://127.0.0.1:{self.port}/e/{episode_key}/v1"

    def close_episode(self, episode_key):
        with self._lock:
            record = self.episodes.pop(episode_key).record
            self.closed[episode_key] = record
            return record

    # ---- serving --------------------------------------------------------------------------------------------------
    def _app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        app = FastAPI()

        @app.post("/e/{key}/v1/chat/completions")
        def chat(key: str, body: dict):
            with self._lock:
                episode = self.episodes.get(key)
            if episode is None:
                reason = f"a call for episode {key}, which is not open (it ended)"
                self.late_calls.append(reason)
                return JSONResponse({"error": {"message": reason, "type": "invalid_request_error",
                                               "code": "episode_closed"}}, status_code=404)
            try:
                return self._complete(episode, body)
            except _Refused as exc:
                episode.record.refused.append(exc.reason)
                return JSONResponse({"error": {"message": exc.reason, "type": "invalid_request_error",
                                               "code": exc.code}}, status_code=400)

        return app

    def _prompt(self, episode: _Episode, messages: list[dict]) -> tuple[list[int], bool]:
        """(prompt ids, extends) for a call's messages."""
        calls = episode.record.calls
        if calls and len(messages) == len(episode.messages) + 1 and messages[:-1] == episode.messages:
            new = messages[-1]
            last = calls[-1]
            ids = self.observations.ids(new["role"], new.get("content") or "", last.completion_ids)
            return last.prompt_ids + last.completion_ids + ids, True
        extra = {} if self.chat_template is None else {"chat_template": self.chat_template}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), False

    def _complete(self, episode: _Episode, body: dict) -> dict:
        messages = [dict(m) for m in body.get("messages") or []]
        if not messages:
            raise _Refused("a call without messages", "invalid_messages")
        prompt, extends = self._prompt(episode, messages)
        room = episode.budget - len(prompt)
        if room < 1:
            raise _Refused(f"the call's prompt has {len(prompt)} tokens: no room left in the episode's budget of "
                           f"{episode.budget}", TOKEN_BUDGET_ERROR)
        cap = min(body.get("max_tokens") or self.max_call_tokens, self.max_call_tokens, room)
        k = len(episode.record.calls) + 1
        seed = self.seeds(episode.seed, episode.sample, k)
        t0 = time.perf_counter()
        ids, logprobs, versions, reason = self.sampler(prompt, cap, seed, episode.temperature)
        seconds = time.perf_counter() - t0
        episode.record.calls.append(CallRecord(prompt, list(ids), list(logprobs), list(versions), reason, extends,
                                               seconds=seconds, engine_s=seconds))
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        episode.messages = [*messages, {"role": "assistant", "content": text}]
        return {"id": f"chatcmpl-{episode.record.episode_key}-{k}", "object": "chat.completion",
                "created": int(time.time()), "model": body.get("model", "policy"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": reason, "token_ids": list(ids)}],
                "prompt_token_ids": prompt,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids)}}


class _Refused(Exception):
    def __init__(self, reason: str, code: str):
        super().__init__(reason)
        self.reason, self.code = reason, code
