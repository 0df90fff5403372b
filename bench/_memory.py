"""Resident memory of one step of this process, above its resting memory (Linux).

Whole-process peak RSS counts everything a process holds: the Python/torch runtime, parameters, gradients, optimizer
state. A step's own memory (activations kept for the backward, logits, temporaries, unsharded parameters) is what
activation checkpointing can change; it is measured here as the step's peak RSS minus the RSS just before the step.

How: before the step, free heap memory is handed back to the OS (glibc ``malloc_trim(0)``, so memory freed by an
earlier step does not count as resting memory), ``VmRSS`` is read from ``/proc/self/status`` (the resting memory),
and the kernel's peak counter is reset by writing ``5`` to ``/proc/self/clear_refs`` (Linux ≥ 4.0, see
``Documentation/filesystems/proc.rst``); after the step ``VmHWM`` is the step's peak. That counter is exact (the
kernel updates it on every RSS change), unlike a sampling thread, which misses short peaks.

The reset also lowers what ``getrusage(RUSAGE_SELF).ru_maxrss`` reports afterwards (the kernel derives it from the
same counter), so a process that uses :class:`StepPeakMeter` reads its whole-process peak from
:attr:`StepPeakMeter.process_peak_gib`, which keeps the largest ``VmHWM`` seen before each reset. torch 2.13 has no
CPU allocator statistics (``torch.cpu`` offers none), so RSS is the measure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from train_workers.host_memory import release_free_heap

KIB_PER_GIB = 2**20


def parse_status_kib(text: str, fields: tuple[str, ...] = ("VmRSS", "VmHWM")) -> dict[str, int]:
    """``{field: KiB}`` from the text of ``/proc/<pid>/status`` (lines such as ``VmRSS:\\t  123456 kB``).

    Raises:
        ValueError: a field in ``fields`` is missing or its value is not ``<integer> kB``.
    """
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in fields:
            parts = rest.split()
            if len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
                raise ValueError(f"/proc status field {name}: expected '<integer> kB', got {rest.strip()!r}")
            values[name] = int(parts[0])
    missing = [f for f in fields if f not in values]
    if missing:
        raise ValueError(f"/proc status: expected fields {list(fields)}, missing {missing}")
    return values


@dataclass(frozen=True)
class StepPeak:
    """One measured step, GiB: ``rest_gib`` the RSS just before it, ``peak_gib`` its peak RSS (``VmHWM``)."""

    rest_gib: float
    peak_gib: float

    @property
    def above_rest_gib(self) -> float:
        """The step's own peak memory: peak RSS minus resting RSS, GiB."""
        return self.peak_gib - self.rest_gib


class StepPeakMeter:
    """Peak RSS of steps of this process, each above its resting RSS: ``start()`` before a step, ``stop()`` after.

    Args:
        proc_dir: the process's ``/proc`` folder (default this process's own).

    Raises:
        RuntimeError: (from ``start``) the peak counter cannot be reset: ``clear_refs`` is missing or not writable
            (not Linux, or a sandbox without it), or writing it left ``VmHWM`` at the peak it should have reset.
    """

    def __init__(self, proc_dir: str | Path = "/proc/self") -> None:
        self._status = Path(proc_dir) / "status"
        self._clear_refs = Path(proc_dir) / "clear_refs"
        self._process_peak_kib = self._read()["VmHWM"]
        self._rest_kib: int | None = None

    def _read(self) -> dict[str, int]:
        return parse_status_kib(self._status.read_text())

    def start(self) -> None:
        """Release free heap, record the resting RSS and reset the peak counter to the current RSS."""
        release_free_heap()
        before = self._read()
        self._process_peak_kib = max(self._process_peak_kib, before["VmHWM"])
        try:
            self._clear_refs.write_text("5")
        except OSError as e:
            raise RuntimeError(f"{self._clear_refs}: expected a writable Linux clear_refs file to reset the peak "
                               f"RSS counter, got {e!r}") from e
        after = self._read()
        if before["VmHWM"] > before["VmRSS"] and after["VmHWM"] >= before["VmHWM"]:
            raise RuntimeError(f"{self._clear_refs}: writing 5 should reset VmHWM to VmRSS ({after['VmRSS']} kB), "
                               f"but VmHWM is {after['VmHWM']} kB (before: {before['VmHWM']} kB)")
        self._rest_kib = after["VmRSS"]

    def stop(self) -> StepPeak:
        """The step since ``start()``: resting RSS and peak RSS.

        Raises:
            RuntimeError: ``start()`` was not called since the last ``stop()``.
        """
        if self._rest_kib is None:
            raise RuntimeError("StepPeakMeter.stop(): expected a start() before it, got none")
        peak = self._read()["VmHWM"]
        self._process_peak_kib = max(self._process_peak_kib, peak)
        step = StepPeak(rest_gib=self._rest_kib / KIB_PER_GIB, peak_gib=peak / KIB_PER_GIB)
        self._rest_kib = None
        return step

    @property
    def process_peak_gib(self) -> float:
        """Whole-process peak RSS since the process started (every reset included), GiB."""
        return max(self._process_peak_kib, self._read()["VmHWM"]) / KIB_PER_GIB

    def rss_gib(self) -> float:
        """Current RSS (``VmRSS``), GiB."""
        return self._read()["VmRSS"] / KIB_PER_GIB
