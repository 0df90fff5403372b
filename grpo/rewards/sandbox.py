"""Run model-written Python programs in a sandbox, with limits, and say whose fault a failure is.

    result = run_program("print(sum(map(int, input().split())))", stdin="2 3\\n")
    result.status, result.stdout  # ("passed", "5\\n")

Modes (``SandboxConfig.mode``):

- ``bwrap`` (default): bubblewrap (Debian package ``bubblewrap``) builds a sandbox with no network, its own PID, IPC,
  UTS and mount namespaces, a read-only view of /usr and of the interpreter's installation only, a size-capped tmpfs
  as the only writable place, an empty environment, and an unprivileged uid (``grpo.rewards.sandbox_launch`` lists
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
(RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core dumps; and, from the harness, wall time and stdout + stderr bytes
(passing either kills the whole sandbox). Tmpfs pages are not address space: the program may hold up to
``memory_mib`` plus ``tmpfs_mib`` in /tmp and again in /dev/shm.

Statuses (:data:`SandboxStatus`): ``passed`` (exit 0 within the limits); the program's own failures: ``failed``
(nonzero exit, an exception, a signal), ``timeout`` (wall time), ``cpu_limit``, ``memory`` (it died of MemoryError),
``output_limit``; and ``infra_error``: the sandbox could not run the program (bwrap missing or refused, a namespace
or uid not available, the interpreter did not start, our own code raised). The line between them is the
bootstrap's "started" byte (``grpo.rewards.sandbox_launch``): before it, nothing of the program ran. A program
failure is the policy's (score 0); an ``infra_error`` is nobody's and must never be scored as 0
(``grpo.rewards.code`` returns None for it).

Exit codes follow the shell convention: 128 + N means killed by signal N (bwrap reports its program so). The
program's ``exit(0)`` before its tests is a pass: the tests run in the same process (``grpo.rewards.code``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, get_args

from grpo.rewards.sandbox_launch import (
    PROGRAM_PATH,
    Interpreter,
    UidSlot,
    acquire_uid_slot,
    bwrap_argv,
    interpreter_argv,
    resolve_interpreter,
    sandbox_env,
    uids_with_processes,
)
from grpo.rewards.sandbox_process import Outcome, supervise
from grpo.rewards.sandbox_seccomp import userns_filter

__all__ = ["Program", "SandboxConfig", "SandboxMode", "SandboxResult", "SandboxStatus", "check_sandbox",
           "run_program", "run_programs"]

SandboxMode = Literal["bwrap", "rlimits"]
SandboxStatus = Literal["passed", "failed", "timeout", "cpu_limit", "memory", "output_limit", "infra_error"]
_MIB = 1 << 20


@dataclass(frozen=True)
class SandboxConfig:
    """Where and under which limits programs run; checked when built (ValueError naming the field, expected vs got).

    Attributes:
        mode: ``bwrap`` (isolated) or ``rlimits`` (weaker, see the module doc).
        cpu_time_s: CPU seconds per process (RLIMIT_CPU), >= 1.
        wall_time_s: wall-clock seconds for the whole program, from the sandbox's start (> 0).
        memory_mib: address space per process (RLIMIT_AS), MiB; >= 64 (the interpreter alone maps ~20 MiB).
        max_processes: processes and threads of the program's uid (RLIMIT_NPROC), >= 1.
        max_output_bytes: stdout + stderr bytes kept; more kills the program (status ``output_limit``).
        max_file_mib: largest file the program may write (RLIMIT_FSIZE), MiB.
        tmpfs_mib: size of /tmp and of /dev/shm (bwrap mode), MiB each.
        max_open_files: file descriptors per process (RLIMIT_NOFILE), >= 16.
        parallel: programs run at once by :func:`run_programs` (default: the machine's CPU count).
        python: interpreter for the programs; "" = the running Python's base installation (``sys.base_prefix``).
        import_site: let the program import site-packages of that installation (off: ``python -S``, standard
            library only, 4x faster start here).
        bwrap_path: the bwrap executable (name on PATH or a path).
        uid_base: first uid of the per-program uids when the harness runs as root (``uid_base + slot``); pick a
            range no real user has.
        uid_count: how many such uids (programs at once on this machine, over all processes).
    """

    mode: SandboxMode = "bwrap"
    cpu_time_s: int = 10
    wall_time_s: float = 20.0
    memory_mib: int = 1024
    max_processes: int = 32
    max_output_bytes: int = _MIB
    max_file_mib: int = 16
    tmpfs_mib: int = 64
    max_open_files: int = 256
    parallel: int = field(default_factory=lambda: os.cpu_count() or 1)
    python: str = ""
    import_site: bool = False
    bwrap_path: str = "bwrap"
    uid_base: int = 60000
    uid_count: int = 1024

    def __post_init__(self) -> None:
        if self.mode not in get_args(SandboxMode):
            raise ValueError(f"SandboxConfig.mode must be one of {get_args(SandboxMode)}, got {self.mode!r}")
        minimum = {"cpu_time_s": 1, "memory_mib": 64, "max_processes": 1, "max_output_bytes": 1, "max_file_mib": 1,
                   "tmpfs_mib": 1, "max_open_files": 16, "parallel": 1, "uid_base": 1, "uid_count": 1}
        for name, low in minimum.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"SandboxConfig.{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.wall_time_s, (int, float)) or not 0 < self.wall_time_s < float("inf"):
            raise ValueError(f"SandboxConfig.wall_time_s must be a finite number > 0, got {self.wall_time_s!r}")
        if self.uid_base + self.uid_count > 65534:
            raise ValueError(f"SandboxConfig.uid_base + uid_count must stay below 65534 (nobody), got "
                             f"{self.uid_base} + {self.uid_count}")


@dataclass(frozen=True)
class Program:
    """One program to run: Python ``source`` and the text fed to its stdin (None: stdin is /dev/null)."""

    source: str
    stdin: str | None = None


@dataclass(frozen=True)
class SandboxResult:
    """What one program did.

    Attributes:
        status: see :data:`SandboxStatus` and the module doc.
        exit_code: 0-255 (128 + N: killed by signal N); None when it never ran or was killed by the harness.
        stdout, stderr: decoded as UTF-8 (invalid bytes replaced), at most ``max_output_bytes`` together.
        seconds: wall time of the sandbox, start to end.
        detail: why, for a status other than passed/failed (the limit, or the infrastructure error's message).
    """

    status: SandboxStatus
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        """Exit 0 within every limit."""
        return self.status == "passed"

    @property
    def infra_error(self) -> bool:
        """The sandbox failed, not the program: no score may come from this result."""
        return self.status == "infra_error"


def _limits(config: SandboxConfig, *, nproc: bool) -> list[str]:
    """The bootstrap's ``NAME:SOFT:HARD`` arguments."""
    limits = [f"CPU:{config.cpu_time_s}:{config.cpu_time_s + 1}", f"AS:{config.memory_mib * _MIB}:"
              f"{config.memory_mib * _MIB}", f"FSIZE:{config.max_file_mib * _MIB}:{config.max_file_mib * _MIB}",
              f"NOFILE:{config.max_open_files}:{config.max_open_files}", "CORE:0:0"]
    return limits + ([f"NPROC:{config.max_processes}:{config.max_processes}"] if nproc else [])


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


def _memfd(name: str, data: bytes) -> int:
    """An anonymous file holding ``data``, positioned at its start (bwrap reads it from the fd)."""
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_bwrap(program: Program, config: SandboxConfig, interpreter: Interpreter) -> Outcome:
    privileged = os.geteuid() == 0
    slot: UidSlot | None = None
    fds: list[int] = []
    try:
        slot = acquire_uid_slot(config.uid_base, config.uid_count) if privileged else None
        program_fd = _memfd("grpo-sandbox-program", program.source.encode("utf-8", "surrogatepass"))
        fds.append(program_fd)
        bpf = userns_filter() if privileged else None
        seccomp = [_memfd("grpo-sandbox-seccomp", bpf)] if bpf is not None else []
        fds += seccomp
        marker_r, marker_w = os.pipe()
        fds += [marker_r, marker_w]
        info_r, info_w = os.pipe()
        fds += [info_r, info_w]
        command = interpreter_argv(interpreter, import_site=config.import_site, marker_fd=marker_w,
                                   program_path=PROGRAM_PATH, limits=_limits(config, nproc=True))
        argv = bwrap_argv(config.bwrap_path, interpreter, privileged=privileged,
                          uid=slot.uid if slot else None, tmpfs_bytes=config.tmpfs_mib * _MIB,
                          program_fd=program_fd, info_fd=info_w, seccomp_fd=seccomp[0] if seccomp else None,
                          command=command)
        return _spawn(argv, program, config, pass_fds=(program_fd, marker_w, info_w, *seccomp),
                      marker_r=marker_r, info_r=info_r, cwd="/", user=None, kill_rest=None)
    finally:
        for fd in fds:
            _close_quietly(fd)
        if slot is not None:
            slot.release()


def _kill_uid(interpreter: Interpreter, uid: int) -> None:
    """SIGKILL every process of ``uid`` (rlimits mode as root) and wait until none runs (up to 5 s).

    A helper running as that uid calls kill(-1), which reaches every process the caller may signal except itself
    (kill(2)). One sweep suffices: it runs under the kernel's task-list lock, which fork needs too, and a process
    with SIGKILL pending cannot fork; a second sweep is kept for safety. The killed processes end a moment later.
    """
    code = "import os\nfor _ in range(2):\n try: os.kill(-1, 9)\n except ProcessLookupError: pass"
    subprocess.run([interpreter.executable, "-I", "-S", "-c", code], user=uid, group=uid, extra_groups=[],
                   env=sandbox_env(), cwd="/", timeout=10, check=False, capture_output=True)
    deadline = time.monotonic() + 5.0
    while uid in uids_with_processes(live_only=True) and time.monotonic() < deadline:
        time.sleep(0.01)


def _run_rlimits(program: Program, config: SandboxConfig, interpreter: Interpreter) -> Outcome:
    privileged = os.geteuid() == 0
    slot: UidSlot | None = None
    work = tempfile.mkdtemp(prefix="grpo-sandbox-")
    fds: list[int] = []
    try:
        # Without a PID namespace, killed processes of an earlier program may linger as zombies until the machine's
        # init reaps them, counting toward RLIMIT_NPROC of their uid: take a uid that has no process at all.
        slot = (acquire_uid_slot(config.uid_base, config.uid_count, skip=uids_with_processes())
                if privileged else None)
        path = os.path.join(work, "main.py")
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(program.source)
        os.chmod(path, 0o444)
        if slot is not None:
            os.chown(work, slot.uid, slot.uid)
        marker_r, marker_w = os.pipe()
        fds += [marker_r, marker_w]
        argv = interpreter_argv(interpreter, import_site=config.import_site, marker_fd=marker_w, program_path=path,
                                limits=_limits(config, nproc=privileged))

        def kill_rest() -> None:
            if slot is not None:
                _kill_uid(interpreter, slot.uid)

        env = {**sandbox_env(), "HOME": work, "TMPDIR": work}
        return _spawn(argv, program, config, pass_fds=(marker_w,), marker_r=marker_r, info_r=None,
                      cwd=work, user=slot.uid if slot else None, kill_rest=kill_rest, env=env)
    finally:
        for fd in fds:
            _close_quietly(fd)
        if slot is not None:
            slot.release()
        shutil.rmtree(work, ignore_errors=True)


def _spawn(argv: list[str], program: Program, config: SandboxConfig, *, pass_fds: tuple[int, ...],
           marker_r: int, info_r: int | None, cwd: str, user: int | None, kill_rest,
           env: dict[str, str] | None = None) -> Outcome:
    """Start ``argv`` in its own session and supervise it (``grpo.rewards.sandbox_process.supervise``); the caller
    owns and closes every fd."""
    stdin = None if program.stdin is None else program.stdin.encode("utf-8", "surrogatepass")
    started_at = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env or sandbox_env(), cwd=cwd,
                            pass_fds=pass_fds, start_new_session=True, user=user, group=user,
                            extra_groups=[] if user is not None else None)
    return supervise(proc, marker_r=marker_r, info_r=info_r, stdin=stdin, wall_time_s=config.wall_time_s,
                     max_output_bytes=config.max_output_bytes, kill_rest=kill_rest, started_at=started_at)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def run_program(source: str | Program, stdin: str | None = None, config: SandboxConfig | None = None
                ) -> SandboxResult:
    """Run one Python program in the sandbox and classify its end (never raises for a sandbox or program failure).

    Args:
        source: the program's Python source, or a :class:`Program` (then ``stdin`` must be None).
        stdin: text fed to its stdin (UTF-8), or None for an empty stdin (/dev/null).
        config: limits and mode; None = ``SandboxConfig()``.

    Returns:
        A :class:`SandboxResult`; ``status == "infra_error"`` (with ``detail``) when the sandbox could not run it,
        including when this harness raised.
    """
    program = source if isinstance(source, Program) else Program(source, stdin)
    if isinstance(source, Program) and stdin is not None:
        raise ValueError("run_program: give stdin inside the Program, not both")
    config = config or SandboxConfig()
    started = time.monotonic()
    try:
        interpreter = resolve_interpreter(config.python)
        run = _run_bwrap if config.mode == "bwrap" else _run_rlimits
        return _classify(run(program, config, interpreter), config)
    except Exception as exc:  # the harness's own failure: never the program's
        return SandboxResult("infra_error", None, "", "", time.monotonic() - started,
                             f"sandbox harness ({config.mode}) raised {type(exc).__name__}: {exc}")


def run_programs(programs: Sequence[str | Program], config: SandboxConfig | None = None) -> list[SandboxResult]:
    """Run many programs, ``config.parallel`` at a time (threads, each supervising one sandbox process).

    Returns:
        One :class:`SandboxResult` per program, in order.
    """
    config = config or SandboxConfig()
    if not programs:
        return []
    workers = min(config.parallel, len(programs))
    if workers == 1:
        return [run_program(p, config=config) for p in programs]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda p: run_program(p, config=config), programs))


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
