"""A seccomp filter that stops a sandboxed program from creating user namespaces (``sandbox.runner``).

Why: when the harness runs as root, bwrap builds the sandbox without a user namespace and the program runs under an
unprivileged uid (see ``sandbox.launch``). Such a uid may still create its own user namespace where the
kernel allows it (``/proc/sys/user/max_user_namespaces`` > 0), and inside one it may mount a tmpfs of any size (a
memory exhaustion that RLIMIT_AS does not see) and reach kernel code unprivileged users otherwise cannot. bwrap's
``--disable-userns`` does this job only inside a user namespace of bwrap's own (the unprivileged path); this filter
does it in the privileged path. It is what Flatpak does (flatpak-run.c, ``setup_seccomp``): ``clone``/``unshare``
with ``CLONE_NEWUSER`` fail with EPERM, and ``clone3`` (whose flags live in memory a filter cannot read) fails with
ENOSYS, so glibc falls back to ``clone``. System calls of another ABI (i386 ``int 0x80``, x32) fail with EPERM.

The filter is classic BPF over ``struct seccomp_data`` (linux/seccomp.h: ``nr`` at offset 0, ``arch`` at 4,
``args[0]`` at 16, low 32 bits first on little-endian machines), as the raw ``struct sock_filter`` array bwrap's
``--seccomp FD`` reads. Built for x86_64 and aarch64; on other machines :func:`userns_filter` returns None.
"""

from __future__ import annotations

import errno
import platform
import struct

__all__ = ["userns_filter"]

# linux/filter.h, linux/seccomp.h, linux/audit.h, linux/sched.h.
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
_ERRNO = 0x00050000  # SECCOMP_RET_ERRNO | errno
_CLONE_NEWUSER = 0x10000000
_X32_SYSCALL_BIT = 0x40000000
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0 = 0, 4, 16

#: machine → (AUDIT_ARCH_*, unshare, clone, clone3, whether x32 numbers exist) from the kernel's syscall tables.
_ABIS: dict[str, tuple[int, int, int, int, bool]] = {
    "x86_64": (0xC000003E, 272, 56, 435, True),
    "aarch64": (0xC00000B7, 97, 220, 435, False),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    """One ``struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}`` in native byte order."""
    return struct.pack("=HBBI", code, jt, jf, k)


def userns_filter(machine: str | None = None) -> bytes | None:
    """The filter as bytes for bwrap ``--seccomp FD`` (the raw instruction array, 8 bytes per instruction).

    Args:
        machine: ``platform.machine()`` name; None means this machine.

    Returns:
        The program, or None for a machine without a table here (then no filter is installed; see the module doc).
    """
    abi = _ABIS.get(machine or platform.machine())
    if abi is None:
        return None
    arch, nr_unshare, nr_clone, nr_clone3, has_x32 = abi
    # Jump offsets count instructions after the jump itself; the labels are the last four instructions.
    body = [
        (_LD_W_ABS, _OFFSET_ARCH, 0, 0),
        (_JEQ, arch, 0, "eperm"),
        (_LD_W_ABS, _OFFSET_NR, 0, 0),
        (_JGE, _X32_SYSCALL_BIT if has_x32 else 0xFFFFFFFF, "eperm", 0),
        (_JEQ, nr_unshare, "flags", 0),
        (_JEQ, nr_clone, "flags", 0),
        (_JEQ, nr_clone3, "enosys", 0),
        (_RET, _ALLOW, 0, 0),
    ]
    tail = {"flags": len(body), "enosys": len(body) + 3, "eperm": len(body) + 4}
    program = []
    for index, (code, k, jt, jf) in enumerate(body):
        jt = tail[jt] - index - 1 if isinstance(jt, str) else jt
        jf = tail[jf] - index - 1 if isinstance(jf, str) else jf
        program.append(_insn(code, k, jt, jf))
    program += [
        _insn(_LD_W_ABS, _OFFSET_ARG0),  # flags: clone's and unshare's first argument
        _insn(_JSET, _CLONE_NEWUSER, 2, 0),  # set: to eperm
        _insn(_RET, _ALLOW),
        _insn(_RET, _ERRNO | errno.ENOSYS),  # enosys
        _insn(_RET, _ERRNO | errno.EPERM),  # eperm
    ]
    return b"".join(program)
