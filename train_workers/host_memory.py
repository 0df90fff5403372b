"""Host memory of a train rank: hand freed heap back to the operating system (glibc).

torch's CPU allocator takes tensor memory from the C library's ``malloc``. glibc serves blocks under its mmap threshold
(128 KiB, rising to at most 32 MiB as large blocks are freed) from heaps it keeps after they are freed, and returns
only whole free pages at a heap's top on its own, so a step of many mid-sized tensors (a decoder layer's parameters,
gradients and activations: 1-15 MiB each for SmolLM2-135M) leaves free but resident memory behind. ``malloc_trim(0)``
returns every whole free page of every heap (``man 3 malloc_trim``; glibc >= 2.8 also releases pages inside a heap).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` or None (musl, macOS)."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def release_free_heap() -> bool:
    """Hand free heap memory back to the OS with glibc's ``malloc_trim(0)``; False where the C library has no
    ``malloc_trim`` (musl, macOS), and then nothing is done."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
