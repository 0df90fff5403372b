"""Headless Chromium (Debian's ``chromium``, installed by scripts/install_test_tools.sh) for tests of the report page:
a screenshot, the DOM after the page's scripts ran, and every console message the page wrote.

Chromium prints console messages on stderr with ``--enable-logging=stderr --v=0`` as ``...:INFO:CONSOLE:<line>]
"<message>", source: <url> (<line>)`` whatever their level (an uncaught exception is one, "Uncaught ..."), so a
page that writes none has no console error. Runs as root need ``--no-sandbox``; each run gets a fresh profile folder
and no network services (background networking, component updates, sync off).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

CONSOLE_MARK = ":CONSOLE"


def chromium() -> str:
    """The Chromium binary; skips the test (with the reason) when there is none."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium not installed (scripts/install_test_tools.sh installs Debian's chromium)")
    return found


def run_chromium(url: str, *args: str, timeout_s: float = 60) -> tuple[str, list[str]]:
    """Open ``url`` headless with ``args`` (``--screenshot=FILE``, ``--dump-dom``, ...); returns (stdout, the
    console lines of stderr)."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        command = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                   "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                   "--enable-logging=stderr", "--v=0", "--window-size=1200,900", "--virtual-time-budget=5000",
                   *args, url]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout, [line for line in done.stderr.splitlines() if CONSOLE_MARK in line]


def screenshot(page: Path, out: Path) -> list[str]:
    """A 1200x900 screenshot of ``page`` in ``out`` (PNG); returns the console lines."""
    _, console = run_chromium(page.resolve().as_uri(), f"--screenshot={out}")
    assert out.is_file(), f"chromium wrote no screenshot to {out}"
    return console


def dom(page: Path, fragment: str = "") -> tuple[str, list[str]]:
    """The DOM of ``page`` (opened at ``#fragment``) after its scripts ran, and the console lines."""
    return run_chromium(page.resolve().as_uri() + (f"#{fragment}" if fragment else ""), "--dump-dom")
