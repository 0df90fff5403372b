"""Command lines that start one sandboxed Python program (``sandbox.runner``): the bwrap invocation, the weaker
``rlimits`` one, the in-sandbox bootstrap that applies the limits, and the per-slot uids.

Inside the sandbox the program sees (bwrap mode)::

    /usr, /bin /lib /lib64 /sbin (as on the host: symlinks into /usr, or read-only binds)   read-only
    /etc/ld.so.cache                                                                       read-only
    the interpreter's installation (sys.base_prefix, at its own path; parent folders empty) read-only
    /sandbox/main.py  the program                                                          read-only
    /proc (its own PID namespace), /dev (null, zero, random, urandom, tty, ...)
    /tmp      working folder and HOME, a tmpfs of tmpfs_mib                                writable
    /dev/shm  a tmpfs of tmpfs_mib (multiprocessing's semaphores)                          writable

Namespaces: PID, network (only a loopback device, down), IPC, UTS, cgroup (when the kernel has it), mount. The
environment is PATH, HOME, LANG and TMPDIR only. bwrap starts the program in a new session (``--new-session``: no
TIOCSTI on a terminal) and kills it when its parent thread dies (``--die-with-parent``).

Privileged path (the harness runs as root): bwrap runs without a user namespace, keeps only CAP_SETUID, CAP_SETGID
and CAP_SETPCAP, and runs ``setpriv`` (util-linux), which switches to the slot's uid/gid (``uid_base + slot``, no
supplementary groups, empty inheritable and bounding capability sets) and execs the interpreter, which thus runs with
no capability at all and under ``no_new_privs`` (bwrap sets it). A real unprivileged uid is what makes RLIMIT_NPROC
count (the kernel never applies it to uid 0, in a user namespace mapped to root neither), and what makes root-owned
files unreadable. The seccomp filter of ``sandbox.seccomp`` refuses new user namespaces. Unprivileged
path (any other uid): bwrap creates a user namespace (``--unshare-user --disable-userns``), the program keeps the
caller's uid, and RLIMIT_NPROC counts the processes of that uid inside the sandbox's own namespace.

Limits are set by the bootstrap (``sandbox.bootstrap``), the first code the sandboxed interpreter runs, before it
reads the program: RLIMIT_CPU, AS, NPROC, FSIZE, NOFILE, CORE. Then it reads the test harness and its request from
the harness pipe (when there is one), writes one byte to the "started" pipe, closes both and runs
``/sandbox/main.py`` as ``__main__``: a failure before that byte is the sandbox's, after it the program's. The
program file holds the program only: tests reach the sandbox through the pipe, never as a file.
"""

from __future__ import annotations

import fcntl
import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BOOTSTRAP", "LAUNCHER", "PROGRAM_PATH", "WORK_DIR", "Interpreter", "UidSlot", "acquire_uid_slot",
           "bwrap_argv", "interpreter_argv", "resolve_interpreter", "sandbox_env", "uids_with_processes"]

#: Where the program lies inside the bwrap sandbox; the working folder (tmpfs) and HOME.
PROGRAM_PATH = "/sandbox/main.py"
WORK_DIR = "/tmp"
#: Host folder of the uid slot lock files (privileged path only).
UID_LOCK_DIR = "/tmp/grpo-sandbox-uids"

#: The ``-c`` command of the sandboxed interpreter: executes the next argument, :data:`BOOTSTRAP`, in a namespace of
#: its own (the program gets ``__main__``'s) and calls its ``main`` with the arguments after it.
LAUNCHER = "import sys; b = {'__name__': 'sandbox_bootstrap'}; exec(sys.argv[1], b); b['main'](sys.argv[2:])"
#: The text of ``sandbox/bootstrap.py``: limits, the "started" byte, the program, the harness.
BOOTSTRAP = Path(__file__).with_name("bootstrap.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Interpreter:
    """The Python that runs programs: ``executable`` (absolute, symlinks resolved), the installation folders to
    expose read-only (``sys.base_prefix`` and ``sys.base_exec_prefix`` of that interpreter, resolved, deduplicated,
    plus the executable's folder when it lies outside them) and ``version`` (``sys.version`` as it reports it)."""

    executable: str
    prefixes: tuple[str, ...]
    version: str


_PROBE = "import sys; print(sys.base_prefix); print(sys.base_exec_prefix); print(sys.version.split()[0])"


@functools.lru_cache(maxsize=8)
def resolve_interpreter(python: str) -> Interpreter:
    """The interpreter a config names: "" means the base installation of the running Python (``sys.base_prefix``,
    not a virtual environment's folder, so site-packages of the venv stay out of the sandbox).

    Raises:
        FileNotFoundError: ``python`` is not an executable file.
        RuntimeError: the interpreter did not report its prefixes (it was started with ``-I -S``, 10 s limit).
    """
    if not python:
        name = f"python{sys.version_info.major}.{sys.version_info.minor}"
        executable = os.path.realpath(os.path.join(sys.base_prefix, "bin", name))
        if not os.access(executable, os.X_OK):
            raise FileNotFoundError(f"the running Python's base interpreter {executable} is not executable; set "
                                    f"SandboxConfig.python")
        prefixes = [sys.base_prefix, sys.base_exec_prefix]
        version = sys.version.split()[0]
    else:
        executable = os.path.realpath(python)
        if not (os.path.isfile(executable) and os.access(executable, os.X_OK)):
            raise FileNotFoundError(f"SandboxConfig.python {python!r} is not an executable file")
        probe = subprocess.run([executable, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=10,
                               env={"PATH": "/usr/bin:/bin"}, check=False)
        lines = probe.stdout.split()
        if probe.returncode != 0 or len(lines) != 3:
            raise RuntimeError(f"SandboxConfig.python {python!r} did not report sys.base_prefix (exit "
                               f"{probe.returncode}): {probe.stderr.strip()[-300:]}")
        prefixes, version = lines[:2], lines[2]
    resolved = list(dict.fromkeys(os.path.realpath(p) for p in prefixes))
    if not any(executable.startswith(p.rstrip("/") + "/") for p in resolved):
        resolved.append(os.path.dirname(executable))
    return Interpreter(executable=executable, prefixes=tuple(resolved), version=version)


def sandbox_env() -> dict[str, str]:
    """The whole environment of the program (and of bwrap itself): nothing of the caller's."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR, "LANG": "C.UTF-8", "TMPDIR": WORK_DIR}


def interpreter_argv(interpreter: Interpreter, *, import_site: bool, marker_fd: int, program_path: str,
                     limits: list[str], harness_fd: int = -1, results_fd: int = -1) -> list[str]:
    """``python -I [-S] -c LAUNCHER BOOTSTRAP MARKER_FD PROGRAM HARNESS_FD RESULTS_FD LIMIT...``
    (``sandbox.bootstrap``; ``-I``: no PYTHON* variables, no user site, no script folder on sys.path; ``-S`` unless
    ``import_site``: no site-packages, 10 ms instead of 40 ms here). ``harness_fd``/``results_fd`` -1: no harness."""
    flags = ["-I"] if import_site else ["-I", "-S"]
    return [interpreter.executable, *flags, "-c", LAUNCHER, BOOTSTRAP, str(marker_fd), program_path,
            str(harness_fd), str(results_fd), *limits]


def _system_binds() -> list[str]:
    """/usr read-only, the top-level /bin /lib... as the host has them (merged-/usr symlinks or folders)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return args


def _prefix_binds(prefixes: tuple[str, ...]) -> list[str]:
    """Read-only binds of the interpreter's folders at their own paths. Their parent folders are made 0755 and empty
    (bwrap would copy the host's modes: a 0700 /root would hide a pyenv Python from the program's uid)."""
    args: list[str] = []
    made: set[str] = set()
    for prefix in prefixes:
        if prefix == "/usr" or prefix.startswith("/usr/"):
            continue
        parts = prefix.strip("/").split("/")
        for depth in range(1, len(parts)):
            parent = "/" + "/".join(parts[:depth])
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", prefix, prefix]
    return args


def bwrap_argv(bwrap: str, interpreter: Interpreter, *, privileged: bool, uid: int | None, tmpfs_bytes: int,
               program_fd: int, info_fd: int, seccomp_fd: int | None, command: list[str]) -> list[str]:
    """The bwrap command line around ``command`` (the interpreter argv with PROGRAM_PATH).

    Args:
        bwrap: the bwrap executable.
        interpreter: whose folders are bound read-only.
        privileged: the caller is root: no user namespace, switch to ``uid`` with setpriv (see the module doc).
        uid: the slot's uid (privileged only).
        tmpfs_bytes: size cap of /tmp and of /dev/shm, each.
        program_fd: fd holding the program source (copied to PROGRAM_PATH, mode 0444).
        info_fd: fd to which bwrap writes ``{"child-pid": N, ...}`` (the PID namespace's init, in our namespace).
        seccomp_fd: fd with the :func:`sandbox.seccomp.userns_filter` program, or None.
        command: what runs in the sandbox.
    """
    args = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox", "--die-with-parent", "--new-session", *_system_binds()]
    args += _prefix_binds(interpreter.prefixes)
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(tmpfs_bytes), "--tmpfs", WORK_DIR,
             "--perms", "1777", "--size", str(tmpfs_bytes), "--tmpfs", "/dev/shm",
             "--perms", "0755", "--dir", os.path.dirname(PROGRAM_PATH),
             "--perms", "0444", "--ro-bind-data", str(program_fd), PROGRAM_PATH,
             "--chdir", WORK_DIR, "--clearenv"]
    for key, value in sandbox_env().items():
        args += ["--setenv", key, value]
    args += ["--info-fd", str(info_fd)]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    if privileged:
        if uid is None:
            raise ValueError("bwrap_argv: privileged=True needs the slot's uid")
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP", "--",
                 "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all", "--"]
    else:
        args += ["--unshare-user", "--disable-userns", "--"]
    return args + command


@dataclass
class UidSlot:
    """A uid held for one program (privileged path): ``uid`` and the open lock file that reserves it; ``release``
    unlocks it. Slots are shared through ``flock`` on files in UID_LOCK_DIR, so processes on one machine (several
    reward workers) never run two programs under one uid at once; a process that dies releases its slots."""

    uid: int
    fd: int

    def release(self) -> None:
        """Unlock and close (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def uids_with_processes(live_only: bool = False) -> set[int]:
    """Owners of the host's processes (from /proc). Zombies count unless ``live_only``: a zombie still counts toward
    its uid's RLIMIT_NPROC until the machine's init reaps it, but it runs nothing."""
    uids = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{name}").st_uid
            if live_only and uid not in uids:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                        continue
        except (OSError, IndexError):
            continue
        uids.add(uid)
    return uids


def acquire_uid_slot(uid_base: int, count: int, skip: set[int] | frozenset[int] = frozenset()) -> UidSlot:
    """The first free uid of ``[uid_base, uid_base + count)`` not in ``skip``.

    Raises:
        RuntimeError: every uid of the range is held (more programs at once than ``count``).
    """
    os.makedirs(UID_LOCK_DIR, mode=0o700, exist_ok=True)
    for uid in range(uid_base, uid_base + count):
        if uid in skip:
            continue
        fd = os.open(os.path.join(UID_LOCK_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return UidSlot(uid=uid, fd=fd)
    raise RuntimeError(f"no free sandbox uid in [{uid_base}, {uid_base + count}) (SandboxConfig.uid_base): more "
                       f"programs run at once on this machine than {count}")
