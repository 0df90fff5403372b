"""The two ways to run one program (``grpo.rewards.sandbox``): in bwrap, and the weaker ``rlimits`` subprocess.

Each returns the supervised process's :class:`~grpo.rewards.sandbox_process.Outcome` (``started``, exit status,
output, which limit killed it); ``grpo.rewards.sandbox`` turns it into a status. Both own every fd and uid slot they
take and release them before returning, also when they raise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable

from grpo.rewards.sandbox_config import MIB, Program, SandboxConfig
from grpo.rewards.sandbox_launch import (
    PROGRAM_PATH,
    Interpreter,
    UidSlot,
    acquire_uid_slot,
    bwrap_argv,
    interpreter_argv,
    sandbox_env,
    uids_with_processes,
)
from grpo.rewards.sandbox_process import Outcome, supervise
from grpo.rewards.sandbox_seccomp import userns_filter

__all__ = ["run_bwrap", "run_rlimits"]


def _limits(config: SandboxConfig, *, nproc: bool) -> list[str]:
    """The bootstrap's ``NAME:SOFT:HARD`` arguments."""
    limits = [f"CPU:{config.cpu_time_s}:{config.cpu_time_s + 1}", f"AS:{config.memory_mib * MIB}:"
              f"{config.memory_mib * MIB}", f"FSIZE:{config.max_file_mib * MIB}:{config.max_file_mib * MIB}",
              f"NOFILE:{config.max_open_files}:{config.max_open_files}", "CORE:0:0"]
    return limits + ([f"NPROC:{config.max_processes}:{config.max_processes}"] if nproc else [])


def _memfd(name: str, data: bytes) -> int:
    """An anonymous file holding ``data``, positioned at its start (bwrap reads it from the fd)."""
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_bwrap(program: Program, config: SandboxConfig, interpreter: Interpreter) -> Outcome:
    """Run ``program`` in bwrap (``grpo.rewards.sandbox_launch`` describes the sandbox). As root it holds a uid slot
    and installs the seccomp filter; otherwise bwrap makes a user namespace.

    Raises:
        OSError: bwrap could not be started (missing, not executable) or a pipe/memfd could not be made.
        RuntimeError: no free uid slot.
    """
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
                          uid=slot.uid if slot else None, tmpfs_bytes=config.tmpfs_mib * MIB,
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


def run_rlimits(program: Program, config: SandboxConfig, interpreter: Interpreter) -> Outcome:
    """Run ``program`` as a plain subprocess with the rlimits, an empty environment and a fresh temporary folder as
    its working folder and HOME (removed afterwards); as root under a uid slot with no process left, killing every
    process of that uid at the end. No network or file-system isolation (see ``grpo.rewards.sandbox``).

    Raises:
        OSError: the interpreter could not be started (e.g. not executable by the slot's uid).
        RuntimeError: no free uid slot.
    """
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

        def kill_rest(proc: subprocess.Popen) -> None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the program's process group (it was started in a new session)
            except ProcessLookupError:
                pass
            if slot is not None:
                _kill_uid(interpreter, slot.uid)  # also what left the group (setsid)

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
           marker_r: int, info_r: int | None, cwd: str, user: int | None,
           kill_rest: Callable[[subprocess.Popen], None] | None,
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
