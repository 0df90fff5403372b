"""A verifier in a worker process: each item runs within its own deadline, from any thread of the caller.

Verifiers such as math-verify bound their work with ``signal.alarm``, which only works on a process's main thread
(it raises elsewhere: the loop scores on a prefetch thread in ``rollout.mode`` one_step_off/async), and a verifier
that hangs inside C code (sympy on a pathological expression) cannot be interrupted at all. So the work runs in a
separate interpreter started with ``subprocess`` (not ``multiprocessing``, so the caller's ``__main__`` is never
re-imported), which loads this file by path (so it imports neither this project's packages nor torch) and then the
target, ``path/to/file.py:function`` (loaded by path) or ``module:function``, with the verifier's own timeouts off;
the caller enforces the deadline: an item that takes longer than ``timeout_s`` has its process killed (SIGKILL) and is
reported as timed out; a fresh process serves the items after it.

Protocol: pickled messages over standard-library ``multiprocessing.connection`` connections on the two pipes, the
child's side on a private copy of its stdout (its fd 1 is pointed at stderr, so prints of the verifier cannot corrupt
messages). The child sends ``("ready",)`` once it has imported the function, then, for each ``(index, item)`` read
from stdin, ``(index, "ok", value)`` or ``(index, "error", "Type: message")``. The child exits when stdin closes or
when its parent process is gone.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, Literal, NamedTuple

__all__ = ["Outcome", "VerifierProcess"]

#: The child's command: load this file by path (not as ``grpo.rewards....``: no package import) and serve.
_BOOTSTRAP = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('grpo_verifier_process', "
              "sys.argv[1]); m = importlib.util.module_from_spec(s); s.loader.exec_module(m); m._serve(sys.argv[2])")


class Outcome(NamedTuple):
    """What became of one item: ``status`` ``ok`` (``value`` is the function's result), ``error`` (``value`` is the
    exception as ``"Type: message"``), ``timeout`` (killed at its deadline) or ``died`` (the process ended by
    itself, e.g. killed for memory)."""

    status: Literal["ok", "error", "timeout", "died"]
    value: Any = None


def _pipe_connections(process: subprocess.Popen) -> tuple[Connection, Connection]:
    """(sender to the child's stdin, receiver of its stdout): standard-library connections on copies of the pipe
    ends; the process's own pipe file objects are closed, so closing the connections closes the pipes."""
    sender = Connection(os.dup(process.stdin.fileno()), readable=False)
    receiver = Connection(os.dup(process.stdout.fileno()), writable=False)
    process.stdin.close()
    process.stdout.close()
    return sender, receiver


class VerifierProcess:
    """Runs ``MODULE:FUNCTION`` on items in a worker process, one at a time, each within ``timeout_s`` seconds.

    Thread-safe (one :meth:`map` at a time); the process starts on first use and is restarted after a timeout or a
    death. ``close`` (also at interpreter exit) ends it.

    Args:
        target: ``"path/to/file.py:function"`` or ``"module:function"`` (importable in a fresh interpreter with this
            process's ``sys.path``); the function takes one picklable item and returns a picklable value.
        timeout_s: seconds one item may take (from when the process starts on it).
        start_timeout_s: seconds the process may take to start and import the function.
    """

    def __init__(self, target: str, timeout_s: float, start_timeout_s: float = 120.0):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.target, self.timeout_s, self.start_timeout_s = target, timeout_s, start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.restarts = 0
        atexit.register(self.close)

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self._proc = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, os.path.abspath(__file__), self.target],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._sender, self._receiver = _pipe_connections(self._proc)
        frame = self._receive(self.start_timeout_s)
        if frame != ("ready",):
            self._kill()
            raise RuntimeError(f"verifier process for {self.target} did not start within {self.start_timeout_s:g} s "
                               f"(got {frame!r}); see its stderr above")

    def _receive(self, timeout_s: float) -> Any:
        """The next message, or None at the deadline or when the process ended."""
        try:
            if not self._receiver.poll(timeout_s):
                return None
            return self._receiver.recv()
        except (EOFError, OSError, pickle.UnpicklingError):
            return None

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._sender.close()
            self._receiver.close()
            self._proc = None

    def map(self, items: Sequence[Any]) -> list[Outcome]:
        """One :class:`Outcome` per item, in order.

        Raises:
            RuntimeError: the process cannot be started (or restarted).
        """
        with self._lock:
            out: list[Outcome] = []
            while len(out) < len(items):
                if self._proc is None:
                    self._start()
                self._run(items, out)
            return out

    def _run(self, items: Sequence[Any], out: list[Outcome]) -> None:
        """Send the items not done yet and collect results until all are done or one times out or dies."""
        first = len(out)
        try:
            for index in range(first, len(items)):
                self._sender.send((index, items[index]))
        except (BrokenPipeError, OSError):
            pass  # the process is gone: the next receive says so
        while len(out) < len(items):
            t0 = time.monotonic()
            frame = self._receive(self.timeout_s)
            if frame is None:
                alive = self._proc.poll() is None and time.monotonic() - t0 >= self.timeout_s
                out.append(Outcome("timeout" if alive else "died"))
                self._kill()
                self.restarts += 1
                return
            index, status, value = frame
            out.append(Outcome(status, value))

    def close(self) -> None:
        """End the worker process (idempotent)."""
        with self._lock:
            self._kill()


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def _serve(target: str) -> None:
    """The child's loop (module docstring)."""
    receiver = Connection(os.dup(0), writable=False)
    sender = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # prints go to stderr, messages to the private copy
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    module, _, name = target.rpartition(":")
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location("grpo_verifier_target", module)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
    else:
        loaded = importlib.import_module(module)
    fn = getattr(loaded, name)
    sender.send(("ready",))
    while True:
        try:
            index, item = receiver.recv()
        except EOFError:
            return
        try:
            frame = (index, "ok", fn(item))
            pickle.dumps(frame)
        except Exception as exc:  # noqa: BLE001 - reported to the caller as this item's error
            frame = (index, "error", f"{type(exc).__name__}: {exc}")
        sender.send(frame)
