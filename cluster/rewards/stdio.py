"""A reward worker as a plain child process exchanging pickled messages over its stdin and stdout (the in-process
runtime's workers, ``cluster.in_process.reward_pool``).

The child is a fresh interpreter started with ``subprocess`` (not ``multiprocessing``: the caller's ``__main__`` is
never imported again, so a script without an ``if __name__ == "__main__"`` guard works, and a reward function may
start ``multiprocessing`` children of its own) running :func:`serve_stdio`.

Protocol, over standard-library ``multiprocessing.connection`` connections on the two pipes (pickled messages,
:func:`parent_connections`, :func:`child_connections`). The parent sends the
:class:`~cluster.rewards.worker.RewardPlan` first; the child answers ``"ready"`` or the
:class:`~cluster.rewards.worker.WireError` that stopped it loading the functions, then answers every
:class:`~contract.rewards.RewardCall` with :meth:`~cluster.rewards.worker.RewardWorkerCore.score`'s result. The
answers go to a private copy of the child's stdout (its fd 1 is pointed at stderr, so what a reward function prints
cannot corrupt them). The child exits when its stdin closes or its parent process is gone.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from multiprocessing.connection import Connection

__all__ = ["CHILD_COMMAND", "child_connections", "parent_connections", "serve_stdio", "watch_parent"]

#: What the parent runs with ``sys.executable -c``.
CHILD_COMMAND = "from cluster.rewards.stdio import serve_stdio; serve_stdio()"


def parent_connections(process: subprocess.Popen) -> tuple[Connection, Connection]:
    """(sender to the child's stdin, receiver of its stdout) for a child started with both as pipes: standard-library
    ``multiprocessing.connection`` connections (length-prefixed pickles; ``recv`` raises EOFError when the child is
    gone, ``poll(timeout)`` waits for a message) on copies of the pipe ends. The process's own pipe file objects are
    closed, so closing the two connections closes the pipes."""
    sender = Connection(os.dup(process.stdin.fileno()), readable=False)
    receiver = Connection(os.dup(process.stdout.fileno()), writable=False)
    process.stdin.close()
    process.stdout.close()
    return sender, receiver


def child_connections() -> tuple[Connection, Connection]:
    """In the child: (receiver of stdin, sender to a private copy of stdout); file descriptor 1 is then pointed at
    stderr, so what the child's code prints cannot corrupt the messages."""
    receiver = Connection(os.dup(0), writable=False)
    sender = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    return receiver, sender


def watch_parent(parent: int) -> None:
    """Exit when the parent process is gone (this process was re-parented)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def serve_stdio() -> None:
    """The child's loop (module docstring)."""
    from cluster.rewards.worker import RewardWorkerCore, WireError

    receiver, sender = child_connections()
    threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        plan = receiver.recv()
        core = RewardWorkerCore(plan)
    except EOFError:
        return
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it at start
        sender.send(WireError("reward", f"reward worker could not load the reward functions: {exc}"))
        return
    sender.send("ready")
    while True:
        try:
            call = receiver.recv()
        except EOFError:
            return
        sender.send(core.score(call))
