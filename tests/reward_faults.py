"""Fault injection for the reward pool's tests (issue #27 item 4): reward functions that fail on marked completions
the way infrastructure fails, and a local HTTP reward service that can be slow, fail, or answer wrongly.

The reward functions live in this importable module (``tests.reward_faults``) so that worker processes and Ray
actors load them by reference. A marked completion starts with its marker:

- ``RAISE``: the verifier raises (``ConnectionError``), for the whole call it is in;
- ``KILL``: the worker process dies in the middle of the call (``os._exit``; never call it so in the test process);
- ``SLOW``: the verifier hangs (sleeps ``SLOW_S`` seconds), past any reasonable per-call timeout;
- ``SANDBOX``: (``code_or_broken_sandbox``) the sandbox cannot start (a ``bwrap`` that exits at once).

:func:`parity_with_gaps` fails by position instead, for whole jobs in the driver (``reward_pool.workers: 0``): a
steady infrastructure-failure rate, and a call that hangs in :data:`STALL` (a stalled step) until the test lets go.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_S = 60.0
#: Every this-many-th completion of a ``parity_with_gaps`` call gets no score: 1 / GAP_EVERY of them fail.
GAP_EVERY = 4


def exact_or_fault(completions, references):
    """1.0 for a completion equal to its reference, else 0.0; a marked one fails as its marker says (module doc)."""
    for c in completions:
        if c.startswith("RAISE"):
            raise ConnectionError("the verifier service went away")
        if c.startswith("KILL"):
            os._exit(9)
        if c.startswith("SLOW"):
            time.sleep(SLOW_S)
    return [float(c == r) for c, r in zip(completions, references)]


def code_or_broken_sandbox(completions, tests, entry_point):
    """The ``code`` reward (``sandbox.code_reward.code_reward``); rows whose completion starts with ``SANDBOX`` run with
    a sandbox whose ``bwrap`` cannot start (``/bin/false`` in its place): the sandbox's own infrastructure failure."""
    from sandbox import SandboxConfig
    from sandbox.code_reward import code_reward

    broken = [i for i, c in enumerate(completions) if c.startswith("SANDBOX")]
    fine = [i for i in range(len(completions)) if i not in broken]
    out = [None] * len(completions)
    for rows, sandbox in ((fine, None), (broken, SandboxConfig(bwrap_path="/bin/false"))):
        if rows:
            scores = code_reward([completions[i] for i in rows], [tests[i] for i in rows],
                                 entry_point=[entry_point[i] for i in rows], sandbox=sandbox)
            for i, s in zip(rows, scores):
                out[i] = s
    return out


class StallGate:
    """Makes one reward call hang, as a verifier that stops answering does (the step stalls): the first call after
    :meth:`arm` for which ``when()`` is true waits until ``until()`` is true (polled every ``poll_s`` seconds from
    the hanging call's thread) or ``deadline_s`` passed.

    Attributes:
        stalled: (start, end) Unix times of the stall, once it ended; None before.
    """

    def __init__(self):
        self.when: Callable[[], bool] | None = None
        self.until: Callable[[], bool] = lambda: True
        self.deadline_s, self.poll_s = 0.0, 0.5
        self.stalled: tuple[float, float] | None = None

    def arm(self, when: Callable[[], bool], until: Callable[[], bool], deadline_s: float, poll_s: float = 0.5) -> None:
        self.when = when
        self.until = until
        self.deadline_s = deadline_s
        self.poll_s = poll_s
        self.stalled = None

    def disarm(self) -> None:
        self.when = None

    def call(self) -> None:
        """Hang here if armed and ``when()`` holds (once)."""
        if self.when is None or not self.when():
            return
        self.when, start = None, time.time()
        while not self.until() and time.time() - start < self.deadline_s:
            time.sleep(self.poll_s)
        self.stalled = (start, time.time())


#: The gate :func:`parity_with_gaps` passes through on every call.
STALL = StallGate()


def parity_with_gaps(completions, references):
    """The ``parity`` test reward (1.0 for an even number of characters) with every :data:`GAP_EVERY`-th completion
    of a call unscored (``UNSCORED``: its verifier failed, an infrastructure failure counted in
    ``reward/infra_failed`` whatever the other rewards give the row); each call passes through :data:`STALL`."""
    from grpo.rewards import UNSCORED

    STALL.call()
    return [UNSCORED if i % GAP_EVERY == 0 else float(len(c) % 2 == 0) for i, c in enumerate(completions)]


class RewardServer:
    """A reward model over HTTP on 127.0.0.1 (``ThreadingHTTPServer`` in a thread): POST ``{"prompts", "completions",
    "answer", ...}`` → ``{"rewards": [1.0 if completion == answer else 0.0, ...]}``.

    Args:
        keep_alive: speak HTTP/1.1 and keep each connection open for the client's next request (a real service's
            way); False: HTTP/1.0, one request per connection.

    Attributes (set them to change what it does):
        delay_s: a request with a completion starting with ``SLOW`` (or every request, with ``slow_all``) waits this
            long before its reply.
        fail_next: the next this-many POSTs answer ``status`` (default 500) with a text body.
        drop_next: the next this-many POSTs get no reply: the connection is closed after the body is read.
        reply: when set, the raw bytes every POST answers (200), e.g. malformed JSON or the wrong count.
        requests: every POST body received, and its headers. peers: the client's ``(host, port)`` of each POST (one
            port per connection).
    """

    def __init__(self, keep_alive: bool = False):
        self.delay_s = 5.0
        self.slow_all = False
        self.fail_next = 0
        self.status = 500
        self.reply = None
        self.drop_next = 0
        self.requests: list[tuple[dict, dict]] = []
        self.peers: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200 if self.path == "/health" else 404, b"ok")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((body, dict(self.headers)))
                    server.peers.append(self.client_address)
                    failing, dropping = server.fail_next > 0, server.drop_next > 0
                    server.fail_next -= failing
                    server.drop_next -= dropping
                if dropping:
                    self.close_connection = True
                    return None
                if failing:
                    return self._send(server.status, b"unavailable")
                if server.slow_all or any(c.startswith("SLOW") for c in body["completions"]):
                    time.sleep(server.delay_s)
                if server.reply is not None:
                    return self._send(200, server.reply)
                rewards = [float(c == a) for c, a in zip(body["completions"], body.get("answer", body["completions"]))]
                self._send(200, json.dumps({"rewards": rewards}).encode())

            def _send(self, status, data):
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/score"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/health"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
