"""An agent worker as a plain child process exchanging pickled messages over its stdin and stdout (the in-process
runtime's agent workers, ``cluster.in_process.agent_pool``), on the reward workers' transport
(``cluster.rewards.stdio``: ``multiprocessing.connection`` frames; the child's own prints go to stderr).

Protocol: the parent sends the :class:`~cluster.agents.plan.AgentPlan` first; the child answers ``("ready", pid)``
or ``("error", message)`` (the agent did not load: the message names its file and line) and then runs every
``(episode id, EpisodeTicket)`` it receives at once, on its event loop (:class:`~cluster.agents.worker.
AgentWorkerCore`), answering ``(episode id, AgentOutcome)`` as each ends, in any order. The child exits when its
stdin closes or its parent process is gone.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from functools import partial

__all__ = ["CHILD_COMMAND", "serve_agent_stdio"]

#: What the parent runs with ``sys.executable -c``.
CHILD_COMMAND = "from cluster.agents.stdio import serve_agent_stdio; serve_agent_stdio()"


def serve_agent_stdio() -> None:
    """The child's loop (module docstring)."""
    from cluster.agents.outcomes import one_line
    from cluster.agents.pool import infra_outcome
    from cluster.agents.worker import AgentWorkerCore
    from cluster.rewards.stdio import watch_parent, child_connections

    receiver, sender = child_connections()
    threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        plan = receiver.recv()
        core = AgentWorkerCore(plan)
    except EOFError:
        return
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it at start
        sender.send(("error", one_line(str(exc), 1000)))
        return
    sender.send(("ready", os.getpid()))
    lock = threading.Lock()

    def reply(rid: int, future: Future) -> None:
        try:
            outcome = future.result()
        except BaseException as exc:  # noqa: BLE001 - the core's own bug: still one outcome per episode
            outcome = infra_outcome(one_line(f"the agent worker failed: {type(exc).__name__}: {exc}"))
        with lock:
            try:
                sender.send((rid, outcome))
            except OSError:
                pass  # the parent is gone

    while True:
        try:
            rid, ticket = receiver.recv()
        except EOFError:
            return
        core.submit(ticket).add_done_callback(partial(reply, rid))
