"""The agent endpoint over HTTP: a FastAPI app served by uvicorn on a background thread of the driver's process, with
its own event loop; :class:`ChatEndpoint` implements :class:`contract.agents.AgentEndpoint` for both runtimes.

    endpoint = ChatEndpoint.from_spec(spec, tokenizer, fleet)       # fleet: a contract.requests.RequestServer
    endpoint.start()
    base_url = endpoint.open_episode("s3-g1-e2", seed=1234, max_episode_tokens=4096)
    # an agent: AsyncOpenAI(base_url=base_url, api_key="-").chat.completions.create(model=..., messages=...)
    record = endpoint.close_episode("s3-g1-e2")
    endpoint.shutdown()

Routes, one base URL per episode (``http://HOST:PORT/episodes/<token>/v1``, the token random):
``POST .../chat/completions`` (``cluster.endpoint.service``), ``GET .../models`` (the one model), and
``GET /health``. An error is an OpenAI error body with the refusal's status and the header ``x-should-retry:
false`` (the ``openai`` client raises ``BadRequestError``/``NotFoundError``/``InternalServerError`` at once instead of
retrying a call that cannot succeed); never a traceback.

FastAPI and uvicorn are what vLLM's own OpenAI server runs on (they come with vLLM; the ``agents`` extra names them
where vLLM is not installed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from cluster.endpoint.chat_request import Refusal
from cluster.endpoint.responses import error_body, model_list
from cluster.endpoint.service import ChatService
from cluster.endpoint.settings import EndpointSettings, advertised_host
from contract.agents import EpisodeRecord
from contract.requests import RequestServer

__all__ = ["ChatEndpoint", "make_app"]

log = logging.getLogger("cluster.endpoint")
#: Seconds to wait for the server thread to serve.
START_TIMEOUT_S = 30.0
NO_RETRY = {"x-should-retry": "false"}


def _error(refusal: Refusal) -> JSONResponse:
    return JSONResponse(error_body(refusal.reason, refusal.code, refusal.status), status_code=refusal.status,
                        headers=NO_RETRY)


def _internal(exc: Exception) -> JSONResponse:
    reason = f"internal error in the agent endpoint: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    log.warning("agent endpoint: %s", reason)
    log.debug("agent endpoint: internal error", exc_info=exc)
    return JSONResponse(error_body(reason, "internal_error", 500), status_code=500, headers=NO_RETRY)


def make_app(service: ChatService, ready: threading.Event | None = None) -> FastAPI:
    """The FastAPI app serving ``service`` (module docstring); ``ready`` is set once it serves."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if ready is not None:
            ready.set()
        yield

    app = FastAPI(title="grpo-cluster agent endpoint", openapi_url=None, docs_url=None, redoc_url=None,
                  lifespan=lifespan)

    @app.post("/episodes/{token}/v1/chat/completions")
    async def chat_completions(token: str, request: Request):
        try:
            answer, _ = await service.complete(token, await request.body())
            return JSONResponse(answer)
        except Refusal as refusal:
            return _error(refusal)
        except Exception as exc:  # a bug of ours: one line to the agent and the log, never a traceback
            return _internal(exc)

    @app.get("/episodes/{token}/v1/models")
    async def models(token: str):
        try:
            service.check_url(token)
        except Refusal as refusal:
            return _error(refusal)
        return JSONResponse(model_list(service.model_name()))

    @app.get("/health")
    async def health():
        return {"status": "ok", "open_episodes": service.open_episodes()}

    return app


class ChatEndpoint:
    """The agent endpoint of a job (module docstring); a :class:`contract.agents.AgentEndpoint`.

    Args:
        settings: ``EndpointSettings``. tokenizer: the model's tokenizer. server: the fleet's request-level side.
        chat_template: ``data.chat_template``'s text, None: the tokenizer's own.

    Raises:
        ObservationTokenError: the chat template cannot delimit messages. ValueError: the tool parser cannot be built.
    """

    def __init__(self, settings: EndpointSettings, tokenizer, server: RequestServer,
                 chat_template: str | None = None):
        self.settings = settings
        self.service = ChatService(settings, tokenizer, server, chat_template)
        self.url: str | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_spec(cls, spec, tokenizer, server: RequestServer) -> ChatEndpoint:
        """The endpoint of a validated ``JobSpec`` (``rollout.endpoint``, sampling, ``data.chat_template``)."""
        from cluster.data import chat_template_text

        return cls(EndpointSettings.from_spec(spec), tokenizer, server, chat_template_text(spec.data))

    def start(self) -> None:
        """Bind ``host:port`` and serve on a background thread (idempotent).

        Raises:
            OSError: naming ``rollout.endpoint.host``/``port``, when the address cannot be bound.
            RuntimeError: the server did not start within :data:`START_TIMEOUT_S`.
        """
        if self._thread is not None:
            return
        s = self.settings
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only for such sockets; without it
        # uvicorn's header and body writes meet the client's delayed ACK and every call waits ~40 ms.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((s.host, s.port))
            sock.listen(2048)
        except OSError as exc:
            sock.close()
            raise OSError(f"rollout.endpoint.host/port: cannot listen on {s.host}:{s.port} ({exc})") from None
        port = sock.getsockname()[1]
        ready = threading.Event()
        config = uvicorn.Config(make_app(self.service, ready), log_level="warning", access_log=False,
                                lifespan="on", timeout_keep_alive=60)
        self._uvicorn = server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, args=(server, sock), name="agent-endpoint", daemon=True)
        self._thread.start()
        if not ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the agent endpoint did not start serving on {s.host}:{port} within "
                               f"{START_TIMEOUT_S:.0f} s")
        self.url = f"http://{advertised_host(s.host, s.advertise_host)}:{port}"
        log.info("agent endpoint serving at %s", self.url)

    @staticmethod
    def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
        """The server thread: uvicorn on its own event loop (signals stay the main thread's)."""
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve(sockets=[sock]))
        finally:
            loop.close()
            sock.close()

    def open_episode(self, episode_key: str, *, seed: int | None, max_episode_tokens: int,
                     group_id: int | None = None, sample: int | None = None,
                     temperature: float | None = None) -> str:
        """Start recording ``episode_key``; its base URL (an OpenAI client's ``base_url``). ``temperature``: the
        loop's for its calls (held-out evaluation), None: the spec's sampling (``ChatService.open``).

        Raises:
            RuntimeError: the endpoint is not started. ValueError: the key is open already, a budget < 2, or a
                negative temperature.
        """
        if self.url is None:
            raise RuntimeError("the agent endpoint is not started (ChatEndpoint.start)")
        token = self.service.open(episode_key, seed=seed, max_episode_tokens=max_episode_tokens, group_id=group_id,
                                  sample=sample, temperature=temperature)
        return f"{self.url}/episodes/{token}/v1"

    def close_episode(self, episode_key: str) -> EpisodeRecord:
        """Stop serving ``episode_key``; its record. Raises KeyError when it is not open."""
        return self.service.close(episode_key)

    def describe(self) -> str:
        where = self.url or "not started"
        return f"agent endpoint at {where} (tool parser {self.settings.tool_parser})"

    def shutdown(self) -> None:
        """Stop serving and join the server thread (idempotent)."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = self._uvicorn = None
        self.url = None
