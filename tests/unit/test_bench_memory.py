"""The step-memory meter of ``bench/_memory.py``: /proc parsing, the peak reset, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._memory import StepPeakMeter, parse_status_kib

MIB = 2**20
STATUS = "Name:\tpython\nVmPeak:\t 900000 kB\nVmHWM:\t  524288 kB\nVmRSS:\t  262144 kB\nThreads:\t3\n"


def test_status_fields_are_read_in_kib() -> None:
    assert parse_status_kib(STATUS) == {"VmRSS": 262144, "VmHWM": 524288}


@pytest.mark.parametrize(("text", "message"), [
    ("VmRSS:\t 1 kB\n", r"missing \['VmHWM'\]"),
    ("VmRSS:\t 1 kB\nVmHWM:\t 2 MB\n", "field VmHWM: expected '<integer> kB', got '2 MB'"),
])
def test_a_missing_or_odd_status_field_is_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_status_kib(text)


def _fake_proc(tmp_path: Path, clear_refs_is_dir: bool) -> Path:
    (tmp_path / "status").write_text(STATUS)
    if clear_refs_is_dir:
        (tmp_path / "clear_refs").mkdir()
    else:
        (tmp_path / "clear_refs").write_text("")
    return tmp_path


def test_an_unwritable_clear_refs_is_refused(tmp_path: Path) -> None:
    meter = StepPeakMeter(_fake_proc(tmp_path, clear_refs_is_dir=True))
    with pytest.raises(RuntimeError, match="expected a writable Linux clear_refs file"):
        meter.start()


def test_a_clear_refs_that_does_not_reset_the_peak_is_refused(tmp_path: Path) -> None:
    meter = StepPeakMeter(_fake_proc(tmp_path, clear_refs_is_dir=False))  # a plain file: VmHWM stays 524288 kB
    with pytest.raises(RuntimeError, match=r"should reset VmHWM to VmRSS \(262144 kB\), but VmHWM is 524288 kB"):
        meter.start()


def test_stop_without_start_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="expected a start"):
        StepPeakMeter(_fake_proc(tmp_path, clear_refs_is_dir=False)).stop()


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc/self/clear_refs")
def test_a_step_counts_its_own_peak_not_an_earlier_larger_one() -> None:
    """An earlier 192 MiB peak (freed) stays in the whole-process peak; the step's 64 MiB is its own peak."""
    meter = StepPeakMeter()
    before = b"\x01" * (192 * MIB)  # written bytes: resident
    del before
    meter.start()
    inside = b"\x02" * (64 * MIB)
    del inside
    step = meter.stop()
    assert 60 * MIB <= step.above_rest_gib * 2**30 <= 96 * MIB
    assert meter.process_peak_gib - step.peak_gib >= 100 / 1024
    meter.start()  # a step that allocates nothing: its peak is its resting RSS, within a few MiB
    assert meter.stop().above_rest_gib * 1024 < 8
