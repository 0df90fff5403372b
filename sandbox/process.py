"""Supervising one sandboxed process (``sandbox.runner``): feed its stdin and the test harness's pipe, read its
stdout/stderr and the harness's results up to a byte cap, enforce the wall-clock limit, notice the bootstrap's
"started" byte, and kill everything it started.

One thread per program, no extra threads: a ``selectors`` loop over the pipes, the "started" pipe, bwrap's info pipe
and a pidfd of the process (readable when it exits). Linux only (``os.pidfd_open``, Linux 5.3, Python 3.9).

Ending (bwrap mode). bwrap's info pipe names the PID namespace's init (bwrap's reaper, pid 1 inside). When the
init exits, by itself once the program's main process ended or because we killed it, the kernel kills every process
of the namespace (pid_namespaces(7)), daemons included, and the init's exit completes only when they are gone. bwrap
itself may exit before that (measured: its init outlived it, reparented to the host's pid 1), so :func:`supervise`
returns only after a pidfd of the init reports its exit. The pidfd is opened as soon as the info arrives and checked
to be in bwrap's new PID namespace, so a recycled pid is never signalled. Before the info arrives the whole process
group of bwrap is killed instead (bwrap ``--die-with-parent`` takes the sandbox down with it).
In rlimits mode the caller's ``kill_rest`` does the job (see ``sandbox.runner``).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["Outcome", "supervise"]

_CHUNK = 1 << 16
#: After the process exited: how long stray holders of its pipes may keep them open before we stop reading (s).
_DRAIN_S = 1.0
#: How long bwrap may take to exit once its namespace's init was killed before its group is killed too (s).
_REAP_S = 5.0


@dataclass
class Outcome:
    """What happened to one process. ``returncode``: 0-255 as a shell reports it (128 + N: killed by signal N; bwrap
    reports its program this way, and a process of ours killed by N is normalised to it); None if it never ran.
    ``started``: the bootstrap's byte arrived (the program itself ran). ``killed_for``: why we killed it, if we did.
    ``seconds``: wall time from start to exit. ``results``: what the test harness wrote to its results pipe."""

    started: bool
    returncode: int | None
    stdout: bytes
    stderr: bytes
    killed_for: Literal["wall", "output"] | None
    seconds: float
    results: bytes = b""


def _open_init_pidfd(info: bytes) -> int | None:
    """A pidfd of the namespace's init named in bwrap's info JSON, or None when the JSON is not complete yet or the
    init is already gone. The pid is checked to still be that init (its PID namespace is the one bwrap made), so a
    recycled pid is never taken for it."""
    try:
        parsed = json.loads(info)
        child, namespace = int(parsed["child-pid"]), int(parsed["pid-namespace"])
    except (ValueError, KeyError, TypeError):
        return None
    try:
        fd = os.pidfd_open(child)
    except OSError:
        return None
    try:
        same = os.readlink(f"/proc/{child}/ns/pid") == f"pid:[{namespace}]"
    except OSError:
        same = False
    if not same:
        os.close(fd)
        return None
    return fd


def _kill(proc: subprocess.Popen, init_fd: int | None) -> None:
    """Kill the sandbox: its init through the pidfd (bwrap then exits), else bwrap's process group."""
    if init_fd is not None:
        try:
            signal.pidfd_send_signal(init_fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=_REAP_S)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _await_init(init_fd: int | None) -> None:
    """Return once the namespace's init has exited, which the kernel lets happen only after every other process of
    the namespace is gone (bwrap may exit first: it reads its program's status from the init, not the init's end).
    Killed if it takes longer than _REAP_S."""
    if init_fd is None:
        return
    with selectors.DefaultSelector() as sel:
        sel.register(init_fd, selectors.EVENT_READ)
        if sel.select(_REAP_S):
            return
        try:
            signal.pidfd_send_signal(init_fd, signal.SIGKILL)
        except ProcessLookupError:
            return
        sel.select(_REAP_S)


def _read_ready(fd: int) -> bytes | None:
    """Whatever can be read now; b"" at EOF; None if nothing is ready."""
    try:
        return os.read(fd, _CHUNK)
    except BlockingIOError:
        return None


class _Loop:
    """State of :func:`supervise`'s select loop (one process)."""

    def __init__(self, proc: subprocess.Popen, marker_r: int, info_r: int | None, stdin: bytes | None,
                 max_output_bytes: int, harness: tuple[int, bytes, int] | None) -> None:
        self.proc = proc
        self.sel = selectors.DefaultSelector()
        self.stdout_fd, self.stderr_fd = proc.stdout.fileno(), proc.stderr.fileno()
        self.results_fd = harness[2] if harness is not None else None
        self.out = {self.stdout_fd: bytearray(), self.stderr_fd: bytearray(),
                    **({self.results_fd: bytearray()} if harness is not None else {})}
        self.open_pipes = set(self.out)
        self.max_output_bytes = max_output_bytes
        self.total = 0
        self.started = False
        self.exited = False
        self.marker_r, self.info_r = marker_r, info_r
        self.info = bytearray()
        self.init_fd: int | None = None
        self.pending = {}  # fd we write to -> what is left to write; the fd is closed once all is written
        self.stdin_fd = proc.stdin.fileno() if stdin is not None else None
        if stdin is not None:
            self.pending[self.stdin_fd] = memoryview(stdin)
        if harness is not None:
            self.pending[harness[0]] = memoryview(harness[1])
        self.pidfd = os.pidfd_open(proc.pid)
        for fd in (*self.out, marker_r, *([info_r] if info_r is not None else [])):
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)
        self.sel.register(self.pidfd, selectors.EVENT_READ)
        for fd in self.pending:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_WRITE)

    def handle(self, fd: int) -> bool:
        """Serve one ready fd; True when the output cap was passed."""
        if fd == self.pidfd:
            self.exited = True
            self.sel.unregister(fd)
        elif fd in self.pending:
            self._write(fd)
        elif fd == self.marker_r:
            self._read_marker()
        elif fd == self.info_r:
            self._read_info()
        else:
            return self._read_output(fd)
        return False

    def _write(self, fd: int) -> None:
        """Feed stdin or the harness pipe; close it once all was written (or the reader is gone)."""
        try:
            written = os.write(fd, self.pending[fd][:_CHUNK])
            self.pending[fd] = self.pending[fd][written:]
        except BlockingIOError:
            return
        except (BrokenPipeError, OSError):
            self.pending[fd] = self.pending[fd][:0]
        if not len(self.pending[fd]):
            self.sel.unregister(fd)
            del self.pending[fd]
            if fd == self.stdin_fd:
                self.proc.stdin.close()
            else:
                os.close(fd)

    def _read_marker(self) -> None:
        data = _read_ready(self.marker_r)
        if data:
            self.started = True
        if data is not None and (data == b"" or self.started):
            self.sel.unregister(self.marker_r)

    def _read_info(self) -> None:
        data = _read_ready(self.info_r)
        if data:
            self.info += data
            if self.init_fd is None:
                self.init_fd = _open_init_pidfd(bytes(self.info))
        if data == b"" or self.init_fd is not None:
            self.sel.unregister(self.info_r)

    def _read_output(self, fd: int) -> bool:
        data = _read_ready(fd)
        if data is None:
            return False
        if data == b"":
            self.sel.unregister(fd)
            self.open_pipes.discard(fd)
            return False
        room = self.max_output_bytes - self.total
        self.out[fd] += data[:max(room, 0)]
        self.total += len(data)
        return self.total > self.max_output_bytes

    def close(self) -> None:
        """Close the selector, the pidfds and our ends of the process's pipes (the harness pipes too)."""
        self.sel.close()
        for fd in self.pending:
            if fd != self.stdin_fd:  # stdin is closed with the process's pipes below
                os.close(fd)
        if self.results_fd is not None:
            os.close(self.results_fd)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        os.close(self.pidfd)
        if self.init_fd is not None:
            os.close(self.init_fd)


def supervise(proc: subprocess.Popen, *, marker_r: int, info_r: int | None, stdin: bytes | None,
              wall_time_s: float, max_output_bytes: int, kill_rest: Callable[[subprocess.Popen], None] | None,
              started_at: float, harness: tuple[int, bytes, int] | None = None) -> Outcome:
    """Run ``proc`` (started with stdout/stderr pipes, and a stdin pipe when ``stdin`` is given) to its end.

    Args:
        proc: the sandbox process (bwrap, or the interpreter in rlimits mode), leader of its own process group.
        marker_r: read end of the "started" pipe.
        info_r: read end of bwrap's ``--info-fd`` pipe, or None (rlimits mode).
        stdin: bytes for the program's stdin (closed after them), or None (stdin was /dev/null).
        wall_time_s: wall-clock limit from ``started_at``; then everything is killed (``killed_for="wall"``).
        max_output_bytes: cap on stdout + stderr together; passing it kills everything (``killed_for="output"``),
            and what was read is kept up to the cap.
        kill_rest: kills what the process may have left behind, given the process; called once it exited (before
            it is reaped) or was killed (rlimits mode; bwrap's PID namespace needs none).
        started_at: ``time.monotonic()`` just before the process was created.
        harness: (write end of the harness pipe, the bytes to write to it, read end of the results pipe), both
            ours from now on (closed here), or None for a program without a harness. The results count toward
            ``max_output_bytes``.

    Returns:
        The :class:`Outcome`; the process is reaped and our ends of its pipes closed (``marker_r`` and ``info_r``
        stay the caller's).
    """
    try:
        loop = _Loop(proc, marker_r, info_r, stdin, max_output_bytes, harness)
    except BaseException:
        _kill(proc, None)
        proc.wait()
        for fd in (harness[0], harness[2]) if harness is not None else ():  # ours, and no loop to close them
            os.close(fd)
        raise
    deadline = started_at + wall_time_s
    killed_for: Literal["wall", "output"] | None = None
    try:
        while killed_for is None and (loop.open_pipes or not loop.exited):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed_for = None if loop.exited else "wall"
                break
            for key, _ in loop.sel.select(remaining):
                was_exited = loop.exited
                if loop.handle(key.fd):
                    killed_for = "output"
                    break
                if loop.exited and not was_exited:
                    if kill_rest is not None:
                        kill_rest(proc)  # before reaping: its pid, the group's id, stays unused until then
                    proc.wait()
                    deadline = min(deadline, time.monotonic() + _DRAIN_S)
        if killed_for is not None:
            _kill(proc, loop.init_fd)
            if kill_rest is not None:
                kill_rest(proc)
        returncode = proc.wait()
        seconds = time.monotonic() - started_at
        _await_init(loop.init_fd)
        if not loop.started:
            loop.started = bool(_read_ready(marker_r))
    finally:
        if proc.poll() is None:  # our own code raised: leave nothing running
            _kill(proc, loop.init_fd)
            proc.wait()
        loop.close()
    if returncode < 0:
        returncode = 128 - returncode
    results = bytes(loop.out[loop.results_fd]) if loop.results_fd is not None else b""
    return Outcome(started=loop.started, returncode=returncode, stdout=bytes(loop.out[loop.stdout_fd]),
                   stderr=bytes(loop.out[loop.stderr_fd]), killed_for=killed_for, seconds=seconds, results=results)
