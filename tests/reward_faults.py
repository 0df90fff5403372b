"""Fault injection for the reward pool's tests (issue #27 item 4): reward functions that fail on marked completions
the way infrastructure fails, and a local HTTP reward service that can be slow, fail, or answer wrongly.

The reward functions live in this importable module (``tests.reward_faults``) so that worker processes and Ray
actors load them by reference. A marked completion starts with its marker:

- ``RAISE``: the verifier raises (``ConnectionError``), for the whole call it is in;
- ``KILL``: the worker process dies in the middle of the call (``os._exit``; never call it so in the test process);
- ``SLOW``: the verifier hangs (sleeps ``SLOW_S`` seconds), past any reasonable per-call timeout;
- ``SANDBOX``: (``code_or_broken_sandbox``) the sandbox cannot start (a ``bwrap`` that exits at once).
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_S = 60.0


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


def code_or_broken_sandbox(completions, tests):
    """The ``code`` reward (``grpo.rewards.code.code_reward``); rows whose completion starts with ``SANDBOX`` run with
    a sandbox whose ``bwrap`` cannot start (``/bin/false`` in its place): the sandbox's own infrastructure failure."""
    from grpo.rewards.code import code_reward
    from grpo.rewards.sandbox import SandboxConfig

    broken = [i for i, c in enumerate(completions) if c.startswith("SANDBOX")]
    fine = [i for i in range(len(completions)) if i not in broken]
    out = [None] * len(completions)
    for rows, sandbox in ((fine, None), (broken, SandboxConfig(bwrap_path="/bin/false"))):
        if rows:
            scores = code_reward([completions[i] for i in rows], [tests[i] for i in rows], sandbox=sandbox)
            for i, s in zip(rows, scores):
                out[i] = s
    return out


class RewardServer:
    """A reward model over HTTP on 127.0.0.1 (``ThreadingHTTPServer`` in a thread): POST ``{"prompts", "completions",
    "answer", ...}`` → ``{"rewards": [1.0 if completion == answer else 0.0, ...]}``.

    Attributes (set them to change what it does):
        delay_s: a request with a completion starting with ``SLOW`` (or every request, with ``slow_all``) waits this
            long before its reply.
        fail_next: the next this-many POSTs answer ``status`` (default 500) with a text body.
        reply: when set, the raw bytes every POST answers (200), e.g. malformed JSON or the wrong count.
        requests: every POST body received, and its headers.
    """

    def __init__(self):
        self.delay_s, self.slow_all, self.fail_next, self.status, self.reply = 5.0, False, 0, 500, None
        self.requests: list[tuple[dict, dict]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200 if self.path == "/health" else 404, b"ok")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((body, dict(self.headers)))
                    failing = server.fail_next > 0
                    server.fail_next -= failing
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
