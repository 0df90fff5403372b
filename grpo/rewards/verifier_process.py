"""A verifier in a worker process: each item runs within its own deadline, from any thread of the caller.

Verifiers such as math-verify bound their work with ``signal.alarm``, which only works on a process's main thread
(it raises elsewhere: the loop scores on a prefetch thread in ``rollout.mode`` one_step_off/async), and a verifier
that hangs inside C code (sympy on a pathological expression) cannot be interrupted at all. So the work runs in a
separate interpreter started with ``subprocess`` (not ``multiprocessing``, so the caller's ``__main__`` is never
re-imported), which loads this file by path (so it imports neither this project's packages nor torch) and then the
target, ``path/to/file.py:function`` (loaded by path) or ``module:function``, with the verifier's own timeouts off;
the caller enforces the deadline: an item that takes longer than ``timeout_s`` has its process killed (SIGKILL) and is
reported as timed out; a fresh process serves the items after it.

Protocol (pickle frames: an 8-byte big-endian length, then the pickled object), on a private copy of the child's
stdout (its fd 1 is pointed at stderr, so prints of the verifier cannot corrupt frames): the child sends ``("ready",)``
once it has imported the function, then, for each ``(index, item)`` frame read from stdin, ``(index, "ok", value)`` or
``(index, "error", "Type: message")``. The child exits when stdin closes or when its parent process is gone.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

__all__ = ["Outcome", "VerifierProcess"]

_HEADER = struct.Struct(">Q")
#: The child's command: load this file by path (not as ``grpo.rewards....``: no package import) and serve.
_BOOTSTRAP = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('grpo_verifier_process', "
              "sys.argv[1]); m = importlib.util.module_from_spec(s); s.loader.exec_module(m); m._serve(sys.argv[2])")


class Outcome(NamedTuple):
    """What became of one item: ``status`` ``ok`` (``value`` is the function's result), ``error`` (``value`` is the
    exception as ``"Type: message"``), ``timeout`` (killed at its deadline) or ``died`` (the process ended by
    itself, e.g. killed for memory)."""

    status: Literal["ok", "error", "timeout", "died"]
    value: Any = None


def _write_frame(fh, obj: Any) -> None:
    data = pickle.dumps(obj)
    fh.write(_HEADER.pack(len(data)) + data)
    fh.flush()


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError("the verifier process closed its output")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int) -> Any:
    (length,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, length))


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
        frame = self._receive(self.start_timeout_s)
        if frame != ("ready",):
            self._kill()
            raise RuntimeError(f"verifier process for {self.target} did not start within {self.start_timeout_s:g} s "
                               f"(got {frame!r}); see its stderr above")

    def _receive(self, timeout_s: float) -> Any:
        """The next frame, or None at the deadline or when the process ended."""
        fd = self._proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            return None
        try:
            return _read_frame(fd)
        except (EOFError, pickle.UnpicklingError, struct.error):
            return None

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for fh in (self._proc.stdin, self._proc.stdout):
                fh.close()
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
                _write_frame(self._proc.stdin, (index, items[index]))
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
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints go to stderr, frames to the private copy
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    module, _, name = target.rpartition(":")
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location("grpo_verifier_target", module)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
    else:
        loaded = importlib.import_module(module)
    fn = getattr(loaded, name)
    _write_frame(out, ("ready",))
    stdin = sys.stdin.buffer.fileno()
    while True:
        try:
            index, item = _read_frame(stdin)
        except EOFError:
            return
        try:
            frame = (index, "ok", fn(item))
            pickle.dumps(frame)
        except Exception as exc:  # noqa: BLE001 - reported to the caller as this item's error
            frame = (index, "error", f"{type(exc).__name__}: {exc}")
        _write_frame(out, frame)
