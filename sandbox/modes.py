"""The two ways to run one program (``sandbox.runner``): in bwrap, and the weaker ``rlimits`` subprocess.

Each returns the supervised process's :class:`~sandbox.process.Outcome` (``started``, exit status, output, the test
harness's results, which limit killed it); ``sandbox.runner`` turns it into a status. Both own every fd and uid slot
they take and release them before returning, also when they raise. A program with a harness request
(``Program.harness``) gets two more pipes: the harness pipe (its read end in the sandbox, the request written by
the supervisor) and the results pipe (its write end in the sandbox).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from sandbox.config import MIB, Program, SandboxConfig
from sandbox.launch import (
    PROGRAM_PATH,
    Interpreter,
    UidSlot,
    acquire_uid_slot,
    bwrap_argv,
    interpreter_argv,
    sandbox_env,
    uids_with_processes,
)
from sandbox.process import Outcome, supervise
from sandbox.seccomp import userns_filter

__all__ = ["run_bwrap", "run_rlimits"]


def _limits(config: SandboxConfig, *, nproc: bool) -> list[str]:
    """The bootstrap's ``NAME:SOFT:HARD`` arguments."""
    limits = [f"CPU:{config.cpu_time_s}:{config.cpu_time_s + 1}", f"AS:{config.memory_mib * MIB}:"
              f"{config.memory_mib * MIB}", f"FSIZE:{config.max_file_mib * MIB}:{config.max_file_mib * MIB}",
              f"NOFILE:{config.max_open_files}:{config.max_open_files}", "CORE:0:0"]
    return limits + ([f"NPROC:{config.max_processes}:{config.max_processes}"] if nproc else [])


class _Fds:
    """The fds one run opens, each closed exactly once: by :meth:`close` as soon as the run no longer needs it, by
    :meth:`close_all` at the end, or never here once :meth:`hand_over` gave it to the supervisor."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def add(self, fd: int) -> int:
        self.held.append(fd)
        return fd

    def pipe(self) -> tuple[int, int]:
        read, write = os.pipe()
        return self.add(read), self.add(write)

    def close(self, *fds: int) -> None:
        for fd in fds:
            self.held.remove(fd)
            os.close(fd)

    def hand_over(self, *fds: int) -> None:
        for fd in fds:
            self.held.remove(fd)

    def close_all(self) -> None:
        while self.held:
            _close_quietly(self.held.pop())


@dataclass(frozen=True)
class _HarnessPipes:
    """The test harness's two pipes: ``inside`` = (harness read end, results write end), the sandbox's;
    ``outside`` = (harness write end, results read end), the supervisor's."""

    inside: tuple[int, int]
    outside: tuple[int, int]

    @classmethod
    def open(cls, fds: _Fds) -> _HarnessPipes:
        harness_r, harness_w = fds.pipe()
        results_r, results_w = fds.pipe()
        return cls((harness_r, results_w), (harness_w, results_r))


def _memfd(name: str, data: bytes) -> int:
    """An anonymous file holding ``data``, positioned at its start (bwrap reads it from the fd)."""
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_bwrap(program: Program, config: SandboxConfig, interpreter: Interpreter) -> Outcome:
    """Run ``program`` in bwrap (``sandbox.launch`` describes the sandbox). As root it holds a uid slot
    and installs the seccomp filter; otherwise bwrap makes a user namespace.

    Raises:
        OSError: bwrap could not be started (missing, not executable) or a pipe/memfd could not be made.
        RuntimeError: no free uid slot.
    """
    privileged = os.geteuid() == 0
    slot: UidSlot | None = None
    fds = _Fds()
    try:
        slot = acquire_uid_slot(config.uid_base, config.uid_count) if privileged else None
        program_fd = fds.add(_memfd("grpo-sandbox-program", program.source.encode("utf-8", "surrogatepass")))
        bpf = userns_filter() if privileged else None
        seccomp = [fds.add(_memfd("grpo-sandbox-seccomp", bpf))] if bpf is not None else []
        marker_r, marker_w = fds.pipe()
        info_r, info_w = fds.pipe()
        harness = _HarnessPipes.open(fds) if program.harness is not None else None
        inside = harness.inside if harness is not None else (-1, -1)
        command = interpreter_argv(interpreter, import_site=config.import_site, marker_fd=marker_w,
                                   program_path=PROGRAM_PATH, limits=_limits(config, nproc=True),
                                   harness_fd=inside[0], results_fd=inside[1])
        argv = bwrap_argv(config.bwrap_path, interpreter, privileged=privileged,
                          uid=slot.uid if slot else None, tmpfs_bytes=config.tmpfs_mib * MIB,
                          program_fd=program_fd, info_fd=info_w, seccomp_fd=seccomp[0] if seccomp else None,
                          command=command)
        return _spawn(argv, program, config, fds, pass_fds=(program_fd, marker_w, info_w, *seccomp),
                      marker_r=marker_r, info_r=info_r, cwd="/", user=None, kill_rest=None, harness=harness)
    finally:
        fds.close_all()
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


def run_rlimits(program: Program, config: SandboxConfig, interpreter: Interpreter) -> Outcome:
    """Run ``program`` as a plain subprocess with the rlimits, an empty environment and a fresh temporary folder as
    its working folder and HOME (removed afterwards); as root under a uid slot with no process left, killing every
    process of that uid at the end. No network or file-system isolation (see ``sandbox.runner``).

    Raises:
        OSError: the interpreter could not be started (e.g. not executable by the slot's uid).
        RuntimeError: no free uid slot.
    """
    privileged = os.geteuid() == 0
    slot: UidSlot | None = None
    work = tempfile.mkdtemp(prefix="grpo-sandbox-")
    fds = _Fds()
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
        marker_r, marker_w = fds.pipe()
        harness = _HarnessPipes.open(fds) if program.harness is not None else None
        inside = harness.inside if harness is not None else (-1, -1)
        argv = interpreter_argv(interpreter, import_site=config.import_site, marker_fd=marker_w, program_path=path,
                                limits=_limits(config, nproc=privileged), harness_fd=inside[0],
                                results_fd=inside[1])

        def kill_rest(proc: subprocess.Popen) -> None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the program's process group (it was started in a new session)
            except ProcessLookupError:
                pass
            if slot is not None:
                _kill_uid(interpreter, slot.uid)  # also what left the group (setsid)

        env = {**sandbox_env(), "HOME": work, "TMPDIR": work}
        return _spawn(argv, program, config, fds, pass_fds=(marker_w,), marker_r=marker_r, info_r=None,
                      cwd=work, user=slot.uid if slot else None, kill_rest=kill_rest, env=env, harness=harness)
    finally:
        fds.close_all()
        if slot is not None:
            slot.release()
        shutil.rmtree(work, ignore_errors=True)


def _spawn(argv: list[str], program: Program, config: SandboxConfig, fds: _Fds, *, pass_fds: tuple[int, ...],
           marker_r: int, info_r: int | None, cwd: str, user: int | None,
           kill_rest: Callable[[subprocess.Popen], None] | None, env: dict[str, str] | None = None,
           harness: _HarnessPipes | None = None) -> Outcome:
    """Start ``argv`` in its own session and supervise it (``sandbox.process.supervise``). The harness pipes' inside
    ends are passed to the process and closed here once it started (so the results pipe ends when the sandbox
    does); their outside ends go to the supervisor. Every other fd stays the caller's."""
    stdin = None if program.stdin is None else program.stdin.encode("utf-8", "surrogatepass")
    started_at = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env or sandbox_env(), cwd=cwd,
                            pass_fds=(*pass_fds, *(harness.inside if harness else ())), start_new_session=True,
                            user=user, group=user, extra_groups=[] if user is not None else None)
    pipes = None
    if harness is not None:
        fds.close(*harness.inside)
        fds.hand_over(*harness.outside)
        pipes = (harness.outside[0], program.harness, harness.outside[1])
    return supervise(proc, marker_r=marker_r, info_r=info_r, stdin=stdin, wall_time_s=config.wall_time_s,
                     max_output_bytes=config.max_output_bytes, kill_rest=kill_rest, started_at=started_at,
                     harness=pipes)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
