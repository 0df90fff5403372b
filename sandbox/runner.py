"""Run model-written Python programs in a sandbox, with limits, and say whose fault a failure is.

    result = run_program("print(sum(map(int, input().split())))", stdin="2 3\\n")
    result.status, result.stdout  # ("passed", "5\\n")

Modes (``SandboxConfig.mode``):

- ``bwrap`` (default): bubblewrap (Debian package ``bubblewrap``) builds a sandbox with no network, its own PID, IPC,
  UTS and mount namespaces, a read-only view of /usr and of the interpreter's installation only, a size-capped tmpfs
  as the only writable place, an empty environment, and an unprivileged uid (``sandbox.launch`` lists
  what the program sees). When the program's main process ends, the namespace's init exits and the kernel kills every
  process left in it, so nothing survives the call.
- ``rlimits``: an explicitly weaker mode for machines where bwrap cannot run (no user namespaces, no bwrap): the
  interpreter as a plain subprocess with the same rlimits, an empty environment and a fresh temporary working folder.
  It does NOT isolate the network nor the file system (the program can read whatever its uid can, connect anywhere,
  and write outside its folder where its uid may). As root it runs the program under a per-slot unprivileged uid and
  kills every process of that uid afterwards; as another user it runs under the caller's uid (it may signal the
  caller's processes), leaves RLIMIT_NPROC unset (it would count all of the user's processes) and kills only the
  program's process group (a daemon that called setsid survives).

Limits (both modes, set in the sandboxed interpreter before the program runs): CPU seconds (RLIMIT_CPU: SIGXCPU,
then SIGKILL a second later), address space (RLIMIT_AS), processes and threads of the uid (RLIMIT_NPROC), file size
(RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core dumps; and, from the supervisor, wall time and stdout + stderr
(+ test results) bytes (passing either kills the whole sandbox). Tmpfs pages are not address space: the program may
hold up to ``memory_mib`` plus ``tmpfs_mib`` in /tmp and again in /dev/shm.

Statuses (:data:`SandboxStatus`): ``passed`` (exit 0 within the limits); the program's own failures: ``failed``
(nonzero exit, an exception, a signal), ``timeout`` (wall time), ``cpu_limit``, ``memory`` (it died of MemoryError),
``output_limit``; and ``infra_error``: the sandbox could not run the program (bwrap missing or refused, a namespace
or uid not available, the interpreter did not start, our own code raised). The line between them is the
bootstrap's "started" byte (``sandbox.launch``): before it, nothing of the program ran. A program
failure is the policy's (score 0); an ``infra_error`` is nobody's and must never be scored as 0
(``sandbox.code_reward`` returns None for it).

Exit codes follow the shell convention: 128 + N means killed by signal N (bwrap reports its program so). A status
says how the process ended, never whether a program is right: a program under test (``Program.harness``) is judged
on the test harness's results (``SandboxResult.results``, ``sandbox.judge``), never on its exit status alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar

from sandbox.config import DEFAULT_SANDBOX, Program, SandboxConfig, SandboxMode, SandboxResult, SandboxStatus
from sandbox.launch import resolve_interpreter
from sandbox.modes import run_bwrap, run_rlimits
from sandbox.process import Outcome

T = TypeVar("T")

__all__ = ["DEFAULT_SANDBOX", "Program", "SandboxConfig", "SandboxMode", "SandboxResult", "SandboxStatus",
           "check_sandbox", "run_program", "run_programs"]


def _classify(outcome: Outcome, config: SandboxConfig) -> SandboxResult:
    """Status of a finished process (see the module doc)."""
    stdout = outcome.stdout.decode("utf-8", "replace")
    stderr = outcome.stderr.decode("utf-8", "replace")
    if not outcome.started:
        why = (f"no start within wall_time_s={config.wall_time_s}" if outcome.killed_for == "wall"
               else f"exit {outcome.returncode}")
        return SandboxResult("infra_error", None, stdout, stderr, outcome.seconds,
                             f"the sandbox did not start the program ({why}): {stderr.strip()[-500:]}")
    if outcome.killed_for == "wall":
        return SandboxResult("timeout", None, stdout, stderr, outcome.seconds,
                             f"killed after wall_time_s={config.wall_time_s}")
    if outcome.killed_for == "output":
        return SandboxResult("output_limit", None, stdout, stderr, outcome.seconds,
                             f"killed after max_output_bytes={config.max_output_bytes}")
    code = outcome.returncode
    if code == 0:
        return SandboxResult("passed", 0, stdout, stderr, outcome.seconds)
    if code == 128 + signal.SIGXCPU:
        return SandboxResult("cpu_limit", code, stdout, stderr, outcome.seconds,
                             f"killed after cpu_time_s={config.cpu_time_s}")
    last_line = (stderr.rstrip().splitlines() or [""])[-1]
    if last_line.startswith("MemoryError"):
        return SandboxResult("memory", code, stdout, stderr, outcome.seconds,
                             f"MemoryError under memory_mib={config.memory_mib}")
    return SandboxResult("failed", code, stdout, stderr, outcome.seconds)


def run_program(source: str | Program, stdin: str | None = None, config: SandboxConfig | None = None
                ) -> SandboxResult:
    """Run one Python program in the sandbox and classify its end (never raises for a sandbox or program failure).

    Args:
        source: the program's Python source, or a :class:`Program` (then ``stdin`` must be None).
        stdin: text fed to its stdin (UTF-8), or None for an empty stdin (/dev/null).
        config: limits and mode; None = ``SandboxConfig()``.

    Returns:
        A :class:`SandboxResult`; ``status == "infra_error"`` (with ``detail``) when the sandbox could not run it,
        including when this supervisor raised.
    """
    program = source if isinstance(source, Program) else Program(source, stdin)
    if isinstance(source, Program) and stdin is not None:
        raise ValueError("run_program: give stdin inside the Program, not both")
    config = config or SandboxConfig()
    started = time.monotonic()
    try:
        interpreter = resolve_interpreter(config.python)
        run = run_bwrap if config.mode == "bwrap" else run_rlimits
        outcome = run(program, config, interpreter)
        return replace(_classify(outcome, config), results=outcome.results)
    except Exception as exc:  # the supervisor's own failure: never the program's
        return SandboxResult("infra_error", None, "", "", time.monotonic() - started,
                             f"sandbox supervisor ({config.mode}) raised {type(exc).__name__}: {exc}")


def run_programs(programs: Sequence[str | Program], config: SandboxConfig | None = None,
                 map_result: Callable[[int, SandboxResult], T] | None = None) -> list[SandboxResult] | list[T]:
    """Run many programs, ``config.parallel`` at a time (threads, each supervising one sandbox process).

    Args:
        programs: sources or :class:`Program` s.
        config: None = ``SandboxConfig()``.
        map_result: applied in the worker thread to (index, result) as soon as a program ends; its value replaces the
            result, so a caller that needs a verdict only does not hold every program's output at once.

    Returns:
        One :class:`SandboxResult` (or ``map_result``'s value) per program, in order.
    """
    config = config or SandboxConfig()
    mapper = map_result or (lambda index, result: result)
    if not programs:
        return []
    workers = min(config.parallel, len(programs))
    if workers == 1:
        return [mapper(i, run_program(p, config=config)) for i, p in enumerate(programs)]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda item: mapper(item[0], run_program(item[1], config=config)), enumerate(programs)))


_PROBE_SOURCE = "import sys\nprint(sys.version.split()[0])\n"


def check_sandbox(config: SandboxConfig | None = None, field_prefix: str = "sandbox") -> str | None:
    """Whether ``config`` can run programs here: None if it can, else the reason, naming the config field.

    Runs one probe program that prints the interpreter's version and compares it with the interpreter's own report
    (a sandbox that loaded another Python's libraries would differ).

    Args:
        config: None = ``SandboxConfig()``.
        field_prefix: how the caller names the config in its messages (e.g. the spec field ``reward.sandbox``).
    """
    config = config or SandboxConfig()
    mode = f"{field_prefix}.mode={config.mode!r}"
    if config.mode == "bwrap":
        if shutil.which(config.bwrap_path) is None:
            return (f"{mode}: bwrap not found ({field_prefix}.bwrap_path={config.bwrap_path!r}); install the "
                    f"Debian package bubblewrap, or choose mode 'rlimits' (no network/file isolation)")
        if os.geteuid() == 0 and not os.access("/usr/bin/setpriv", os.X_OK):
            return f"{mode}: /usr/bin/setpriv (util-linux) is needed as root to run programs under their own uid"
    try:
        interpreter = resolve_interpreter(config.python)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"{field_prefix}.python={config.python!r}: {exc}"
    result = run_program(_PROBE_SOURCE, config=config)
    if result.status != "passed":
        return (f"{mode}: a probe program ended {result.status} ({result.detail or result.stderr.strip()[-300:]}); "
                f"the sandbox cannot run here")
    if result.stdout.strip() != interpreter.version:
        return (f"{field_prefix}.python={config.python!r}: the sandboxed interpreter reports Python "
                f"{result.stdout.strip()!r}, expected {interpreter.version!r} ({interpreter.executable})")
    return None
