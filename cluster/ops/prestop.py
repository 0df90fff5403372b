"""The Ray pods' preStop hook (deploy/k8s): a pod eviction or a RayCluster deleted gives the job its preemption
checkpoint (``checkpoint.on_preempt``, :mod:`cluster.loop.preemption`).

    python -m cluster.ops.prestop drivers [--timeout-s S]   # head pod: SIGTERM each grpo-cluster driver, wait for it
    python -m cluster.ops.prestop actors [--timeout-s S]    # worker pods: wait until this pod's Ray actors are gone

Kubernetes runs a container's preStop hook before it sends SIGTERM to the container's first process (here Ray's
``ray start --block``) and kills whatever is left after the pod's ``terminationGracePeriodSeconds``, which bounds the
hook too. KubeRay forwards no signal to a Ray job's driver, so on the head the hook sends it the SIGTERM ``ray job
stop`` would and waits while it finishes or abandons its step and checkpoints; on the workers it waits while the
job's actors (train ranks, engines) still run, so that the train ranks can write their part of that checkpoint before
their pod goes. Idle Ray worker processes (``ray::IDLE``) are not waited for: an idle pod goes at once.

Exit code 0, also when the timeout passed (the kubelet goes on either way); one line per driver signalled, and one
when the wait ends.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

import psutil

#: Default wait, seconds: deploy/k8s sets ``--timeout-s`` from the spec's deadline, and the grace period bounds it.
DEFAULT_TIMEOUT_S = 150.0


def is_driver(cmdline: Sequence[str]) -> bool:
    """Whether a command line runs a ``grpo-cluster run`` driver: ``grpo-cluster run ...`` (the console script, run
    by its interpreter or not) or ``python -m cluster.cli run ...`` (``grpo-cluster submit``'s entrypoint)."""
    words = list(cmdline)
    for i, word in enumerate(words[:-1]):
        if os.path.basename(word) == "grpo-cluster" and words[i + 1] == "run":
            return True
        if word == "-m" and words[i + 1] == "cluster.cli" and i + 2 < len(words) and words[i + 2] == "run":
            return True
    return False


def is_busy_actor(cmdline: Sequence[str]) -> bool:
    """Whether a process is a Ray actor or task at work (its title ``ray::<Class>[.<method>]``), not an idle worker
    (``ray::IDLE``) nor a Ray daemon."""
    title = " ".join(cmdline)
    return title.startswith("ray::") and not title.startswith("ray::IDLE")


def matching(predicate: Callable[[Sequence[str]], bool]) -> list[psutil.Process]:
    """This machine's processes (this one aside) whose command line satisfies ``predicate``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != os.getpid() and predicate(proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_gone(procs: Sequence[psutil.Process], timeout_s: float, poll_s: float = 0.5) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` until none of ``procs`` runs (a zombie counts as gone); returns those still
    running."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = []
        for proc in procs:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    running.append(proc)
            except psutil.NoSuchProcess:
                continue
        if not running or time.monotonic() >= deadline:
            return running
        psutil.wait_procs(running, timeout=min(poll_s, max(0.0, deadline - time.monotonic())))


def stop_drivers(drivers: Sequence[psutil.Process], timeout_s: float, say: Callable[[str], None]) -> int:
    """SIGTERM each of ``drivers`` and wait up to ``timeout_s`` for all to exit; returns how many still run."""
    for proc in drivers:
        try:
            proc.send_signal(signal.SIGTERM)
            say(f"preStop: SIGTERM sent to the grpo-cluster driver {proc.pid}")
        except psutil.NoSuchProcess:
            continue
    left = wait_gone(drivers, timeout_s)
    say(f"preStop: {len(drivers) - len(left)} driver(s) exited, {len(left)} still running after {timeout_s:g} s")
    return len(left)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.ops.prestop", description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("drivers", "actors"),
                        help="drivers: SIGTERM each grpo-cluster driver and wait (head pod); actors: wait until this "
                             "pod's busy Ray actors are gone (worker pods)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="longest wait, seconds")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.role == "drivers":
        stop_drivers(matching(is_driver), args.timeout_s, say)
    else:
        left = wait_gone(matching(is_busy_actor), args.timeout_s)
        say(f"preStop: {len(left)} busy Ray actor process(es) left after the wait")
    return 0


if __name__ == "__main__":
    sys.exit(main())
