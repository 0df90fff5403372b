"""A reward worker as a plain child process speaking pickle frames over its stdin and stdout (the in-process runtime's
workers, ``cluster.in_process.reward_pool``).

The child is a fresh interpreter started with ``subprocess`` (not ``multiprocessing``: the caller's ``__main__`` is
never imported again, so a script without an ``if __name__ == "__main__"`` guard works, and a reward function may
start ``multiprocessing`` children of its own) running :func:`serve_stdio`.

Protocol. A frame is an 8-byte big-endian length, then a pickled object. The parent sends the
:class:`~cluster.rewards.worker.RewardPlan` first; the child answers ``"ready"`` or the
:class:`~cluster.rewards.worker.WireError` that stopped it loading the functions, then answers every
:class:`~contract.rewards.RewardCall` frame with :meth:`~cluster.rewards.worker.RewardWorkerCore.score`'s result. The
frames go to a private copy of the child's stdout (its fd 1 is pointed at stderr, so what a reward function prints
cannot corrupt them). The child exits when its stdin closes or its parent process is gone.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
from typing import Any, BinaryIO

__all__ = ["CHILD_COMMAND", "read_frame", "serve_stdio", "write_frame"]

_HEADER = struct.Struct(">Q")
#: What the parent runs with ``sys.executable -c``.
CHILD_COMMAND = "from cluster.rewards.stdio import serve_stdio; serve_stdio()"


def write_frame(fh: BinaryIO, obj: Any) -> None:
    """Pickle ``obj`` into one frame on ``fh`` and flush.

    Raises:
        pickle.PicklingError (or AttributeError, TypeError): ``obj`` cannot be pickled. OSError: ``fh`` is closed.
    """
    data = pickle.dumps(obj)
    fh.write(_HEADER.pack(len(data)) + data)
    fh.flush()


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> Any:
    """The next frame's object from file descriptor ``fd`` (blocks until it is whole).

    Raises:
        EOFError: the pipe closed (the other side is gone).
    """
    (length,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, length))


def _watch_parent(parent: int) -> None:
    """Exit when the parent process is gone (this process was re-parented)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def serve_stdio() -> None:
    """The child's loop (module docstring)."""
    from cluster.rewards.worker import RewardWorkerCore, WireError

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    stdin = sys.stdin.buffer.fileno()
    try:
        plan = read_frame(stdin)
        core = RewardWorkerCore(plan)
    except EOFError:
        return
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it at start
        write_frame(out, WireError("reward", f"reward worker could not load the reward functions: {exc}"))
        return
    write_frame(out, "ready")
    while True:
        try:
            call = read_frame(stdin)
        except EOFError:
            return
        write_frame(out, core.score(call))
