"""``grpo-cluster report RUN [--out FILE]``: one self-contained HTML page of a run — its curves, its held-out
evaluation table and a browser of its samples — that opens offline, with no server.

    grpo-cluster report runs/demo_cpu                 # writes runs/demo_cpu/report.html
    grpo-cluster report runs/demo_cpu --out demo.html

``run`` reads the run folder (:func:`cluster.sinks.report.run.read_run`), ``curves`` draws the panels with plotly,
``page`` puts it all, plotly's JavaScript included, into one HTML file; ``browser.js`` and ``report.css`` are the
page's own script and styles. A run still being written gets a page of what is there, and a note says so.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DEFAULT_HTML", "ReportError", "write_report"]

DEFAULT_HTML = "report.html"


class ReportError(ValueError):
    """The report cannot be written as asked (a bad ``--out``); the message names what and why."""


def _check_out(out: Path) -> None:
    """Refuse an ``--out`` that is not an ``.html`` name, is a folder, or would overwrite a file that is not an HTML
    page (an earlier report may be replaced)."""
    if out.suffix.lower() not in (".html", ".htm"):
        raise ReportError(f"--out {out}: expected an .html file name (the report is one HTML page)")
    if out.is_dir():
        raise ReportError(f"--out {out}: is a folder; expected an .html file name")
    if out.is_file():
        with out.open("rb") as f:
            head = f.read(64).lstrip().lower()
        if not (head.startswith(b"<!doctype html") or head.startswith(b"<html")):
            raise ReportError(f"--out {out}: exists and is not an HTML page; refusing to overwrite it")
    if not out.parent.is_dir():
        raise ReportError(f"--out {out}: its folder {out.parent} does not exist")


def write_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, list[str]]:
    """Write the report of the run folder ``run_dir`` to ``out`` (default ``RUN_DIR/report.html``), atomically (a
    page is never left half-written).

    Returns:
        (the page's path, the notes of what the reading left out, one line each).

    Raises:
        PlotError: ``run_dir`` is not a run folder (``cluster.sinks.plot.run_records``).
        ReportError: a bad ``out``, or the page cannot be written there (a read-only folder, a full disk).
    """
    from cluster.sinks.report.page import render_page
    from cluster.sinks.report.run import read_run

    run_dir = Path(run_dir)
    view = read_run(run_dir)
    out = run_dir / DEFAULT_HTML if out is None else Path(out)
    _check_out(out)
    page = render_page(view)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ReportError(f"cannot write the page {out}: {exc.strerror or exc} (in {out.parent}); choose a writable "
                          f"place with --out FILE.html") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out, view.notes

