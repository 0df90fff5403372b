"""Types of the sandbox (``sandbox.runner``): its config, one program, one result and the status names."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, get_args

__all__ = ["DEFAULT_SANDBOX", "MIB", "Program", "SandboxConfig", "SandboxMode", "SandboxResult", "SandboxStatus"]

SandboxMode = Literal["bwrap", "rlimits"]
SandboxStatus = Literal["passed", "failed", "timeout", "cpu_limit", "memory", "output_limit", "infra_error"]
MIB = 1 << 20


@dataclass(frozen=True)
class SandboxConfig:
    """Where and under which limits programs run; checked when built (ValueError naming the field, expected vs got).

    Attributes:
        mode: ``bwrap`` (isolated) or ``rlimits`` (weaker, see the module doc).
        cpu_time_s: CPU seconds per process (RLIMIT_CPU), >= 1.
        wall_time_s: wall-clock seconds for the whole program, from the sandbox's start (> 0).
        memory_mib: address space per process (RLIMIT_AS), MiB; >= 64 (the interpreter alone maps ~20 MiB).
        max_processes: processes and threads of the program's uid (RLIMIT_NPROC), >= 1.
        max_output_bytes: stdout + stderr (+ the harness's results) bytes kept; more kills the program (status
            ``output_limit``).
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
    max_output_bytes: int = MIB
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
        if (not isinstance(self.wall_time_s, (int, float)) or isinstance(self.wall_time_s, bool)
                or not 0 < self.wall_time_s < float("inf")):
            raise ValueError(f"SandboxConfig.wall_time_s must be a finite number > 0, got {self.wall_time_s!r}")
        if self.parallel > self.uid_count:
            raise ValueError(f"SandboxConfig.parallel ({self.parallel}) must not exceed uid_count ({self.uid_count}): "
                             f"each program at once needs a uid of its own")
        if self.uid_base + self.uid_count > 65534:
            raise ValueError(f"SandboxConfig.uid_base + uid_count must stay below 65534 (nobody), got "
                             f"{self.uid_base} + {self.uid_count}")


#: The limits the ``code`` rewards and the ``python`` tool use unless given others.
DEFAULT_SANDBOX = SandboxConfig()


@dataclass(frozen=True)
class Program:
    """One program to run: Python ``source``, the text fed to its stdin (None: stdin is /dev/null) and, for a
    program run under a test harness, the harness's request (``sandbox.bootstrap``: JSON bytes read by the
    sandboxed interpreter through a pipe, to its end, before the program starts; None: the program alone)."""

    source: str
    stdin: str | None = None
    harness: bytes | None = None


@dataclass(frozen=True)
class SandboxResult:
    """What one program did.

    Attributes:
        status: see :data:`SandboxStatus` and the module doc.
        exit_code: 0-255 (128 + N: killed by signal N); None when it never ran or was killed by the harness.
        stdout, stderr: decoded as UTF-8 (invalid bytes replaced), at most ``max_output_bytes`` together.
        seconds: wall time of the sandbox, start to end.
        detail: why, for a status other than passed/failed (the limit, or the infrastructure error's message).
        results: what the harness wrote to its results pipe (``sandbox.bootstrap``'s frames; b"" for a program
            run without a harness); counted in ``max_output_bytes`` with stdout and stderr.
    """

    status: SandboxStatus
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    detail: str = ""
    results: bytes = b""

    @property
    def passed(self) -> bool:
        """Exit 0 within every limit."""
        return self.status == "passed"

    @property
    def infra_error(self) -> bool:
        """The sandbox failed, not the program: no score may come from this result."""
        return self.status == "infra_error"
