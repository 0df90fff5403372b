"""``grpo-cluster report RUN [--out FILE]``: one self-contained HTML page of a run folder (its curves, its held-out
evaluation table and a browser of its samples) that opens offline; the work is ``cluster.sinks.report``.

Exit codes: 0 written (notes on what was left out go to stderr, one line each); 2 ``RUN`` is not a run folder (no
folder, no ``metrics.jsonl``, a line before its last that is not JSON, no step), a bad ``--out``, or the page cannot
be written, plotly missing — one line on stderr, never a traceback.
"""

from __future__ import annotations

import sys


def _cmd_report(args) -> int:
    from cluster.sinks.plot import PlotError
    from cluster.sinks.report import ReportError, write_report

    try:
        out, notes = write_report(args.run_dir, args.out)
    except (PlotError, ReportError) as exc:
        print(f"grpo-cluster report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"grpo-cluster report: cannot write the page: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # plotly, a dependency of the package: an environment set up without it
        print(f"grpo-cluster report: needs the {exc.name} package, not installed in {sys.executable}; run "
              f"`make setup` or `pip install -e .`", file=sys.stderr)
        return 2
    for note in notes:
        print(f"grpo-cluster report: note: {note}", file=sys.stderr)
    print(f"wrote {out}")
    return 0


def add_report_command(sub) -> None:
    """Add ``report`` to the ``grpo-cluster`` subparsers ``sub``."""
    p = sub.add_parser("report", help="one HTML page of a run: curves, eval table, samples (opens offline)")
    p.add_argument("run_dir", help="the job's output_dir (holds metrics.jsonl and samples.jsonl)")
    p.add_argument("--out", default=None, help="the HTML file to write; default RUN_DIR/report.html")
    p.set_defaults(func=_cmd_report)
