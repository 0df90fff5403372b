"""`grpo-cluster plot`: the series each panel draws (cluster.sinks.plot.plot_data, no matplotlib), the PNG it writes
for a synthetic metrics.jsonl with and without eval/monitor keys, and the refusals (exit 2)."""

from __future__ import annotations

import json
import struct

import pytest

from cluster.cli import main
from cluster.sinks.plot import PlotError, plot_data, plot_run, series

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _train_row(step: int) -> dict:
    return {"step": step, "reward/mean": 0.1 * step, "reward/accuracy": 0.05 * step, "reward/format": 0.5,
            "reward/std": 0.3, "reward/failed": 0, "reward/none_fraction": 0.0,
            "response_length/mean": 100.0 - step, "actor/kl": None if step == 1 else 0.01 * step}


def _records(with_eval: bool, with_monitor: bool, steps: int = 8) -> list[dict]:
    rows = []
    for step in range(1, steps + 1):
        row = _train_row(step)
        if with_monitor:
            row |= {"monitor/length_drift": float(step >= 6), "monitor/kl_band": float(step == 7),
                    "monitor/tripped": float(step >= 6)}
        rows.append(row)
        if with_eval and step in (1, 4, 8):  # eval rows: sparse, logged as their own records
            acc = 0.02 * step
            rows.append({"step": step, "eval/accuracy": acc, "eval/accuracy_ci_low": acc - 0.01,
                         "eval/accuracy_ci_high": acc + 0.02, "eval/n": 200, "eval/best_accuracy": acc})
    return rows


def _write_run(tmp_path, records) -> object:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_series_keeps_finite_numbers_in_step_order_and_skips_missing_and_null():
    records = [{"step": 1, "a": 1.0}, {"step": 2}, {"step": 3, "a": None}, {"step": 4, "a": True},
               {"a": 9.0}, {"step": 5, "a": "x"}, {"step": 6, "a": 2}]
    s = series(records, "a")
    assert (s.steps, s.values) == ((1, 4, 6), (1.0, 1.0, 2.0))
    assert series(records, "absent") is None


def test_a_step_logged_again_keeps_its_last_value_but_its_trip_stays():
    """A rollback redoes steps 3-4: the curves show the history as it stands, the trip at step 4 stays marked."""
    records = [{"step": s, "actor/kl": 0.1 * s, "monitor/kl_band": 0.0, "monitor/tripped": 0.0} for s in (1, 2, 3)]
    records += [{"step": 4, "actor/kl": 2.0, "monitor/kl_band": 1.0, "monitor/tripped": 1.0}]
    records += [{"step": s, "actor/kl": 0.01, "monitor/kl_band": 0.0, "monitor/tripped": 0.0} for s in (3, 4, 5)]
    data = plot_data(records)
    assert data.kl.steps == (1, 2, 3, 4, 5)
    assert data.kl.values == pytest.approx((0.1, 0.2, 0.01, 0.01, 0.01))
    assert data.trips == (4,) and data.detectors == {"kl_band": (4,)}


def test_plot_data_panels_from_a_full_run():
    data = plot_data(_records(with_eval=True, with_monitor=True))
    assert [s.key for s in data.rewards] == ["reward/mean", "reward/accuracy", "reward/format"]  # no std/failed/...
    assert data.rewards[0].values == pytest.approx([0.1 * s for s in range(1, 9)])
    assert data.eval_accuracy.steps == (1, 4, 8)
    assert data.eval_accuracy.values == pytest.approx((0.02, 0.08, 0.16))
    assert data.eval_low.values == pytest.approx((0.01, 0.07, 0.15))
    assert data.eval_high.values == pytest.approx((0.04, 0.10, 0.18))
    assert data.eval_best.steps == (1, 4, 8)
    assert data.length.values == tuple(100.0 - s for s in range(1, 9))
    assert data.kl.steps == tuple(range(2, 9))  # step 1 logged null (NaN)
    assert data.detectors == {"length_drift": (6, 7, 8), "kl_band": (7,)}
    assert data.trips == (6, 7, 8)
    assert data.guard_logged and data.num_steps == 8


def test_plot_data_without_eval_or_monitor_marks_those_panels_absent():
    data = plot_data(_records(with_eval=False, with_monitor=False))
    assert data.eval_accuracy is None and data.eval_low is None and data.eval_best is None
    assert data.detectors == {} and data.trips == () and not data.guard_logged
    empty = plot_data([{"step": 1}])
    assert empty.rewards == () and empty.length is None and empty.kl is None and empty.num_steps == 1


@pytest.mark.parametrize("with_eval,with_monitor", [(True, True), (False, False), (True, False), (False, True)])
def test_plot_writes_a_png(tmp_path, with_eval, with_monitor):
    run = _write_run(tmp_path, _records(with_eval, with_monitor))
    out = plot_run(run)
    assert out == run / "plot.png"
    width, height = _png_size(out)
    assert (width, height) == (1000, 1300)
    assert out.stat().st_size > 20_000  # five drawn panels, not a blank canvas


def test_plot_of_a_run_with_no_known_keys_still_draws(tmp_path):
    run = _write_run(tmp_path, [{"step": 1, "timing/step_s": 3.0}, {"step": 2, "timing/step_s": 3.1}])
    assert _png_size(plot_run(run, tmp_path / "sub" / "p.png")) == (1000, 1300)


def test_cli_plot_writes_to_out(tmp_path, capsys):
    run = _write_run(tmp_path, _records(with_eval=True, with_monitor=True))
    out = tmp_path / "pictures" / "run.png"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    assert out.is_file() and str(out) in capsys.readouterr().out
    assert not (run / "plot.png").exists()


@pytest.mark.parametrize("setup,needle", [
    (lambda p: p / "missing", "not found"),
    (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "is a file, not a folder"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "no metrics.jsonl"),
    (lambda p: _write_run(p, []), "no step records"),
])
def test_cli_plot_refuses_a_run_without_metrics(tmp_path, capsys, setup, needle):
    run = setup(tmp_path)
    assert main(["plot", str(run)]) == 2
    assert needle in capsys.readouterr().err


def test_plot_refuses_a_line_that_is_not_json(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2\n')
    with pytest.raises(PlotError, match=r"metrics.jsonl:2: invalid JSON"):
        plot_run(run)


def test_out_that_would_destroy_a_file_is_refused_and_the_file_kept(tmp_path, capsys):
    """``--out`` naming the run's metrics.jsonl, another existing file, or a non-.png name exits 2 and writes
    nothing; an earlier plot (a PNG) may be replaced."""
    run = _write_run(tmp_path, _records(with_eval=False, with_monitor=False))
    before = (run / "metrics.jsonl").read_bytes()
    (run / "spec.yaml").write_text("name: x\n")
    for out, needle in ((run / "metrics.jsonl", "expected a .png"), (run / "spec.yaml", "expected a .png"),
                        (tmp_path / "x.svg", "expected a .png")):
        assert main(["plot", str(run), "--out", str(out)]) == 2
        assert needle in capsys.readouterr().err
    (run / "notes.png").write_text("my notes, not a picture")
    assert main(["plot", str(run), "--out", str(run / "notes.png")]) == 2
    assert "is not a PNG" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_bytes() == before and not (tmp_path / "x.svg").exists()
    assert (run / "notes.png").read_text() == "my notes, not a picture"
    first = plot_run(run)
    assert plot_run(run, first) == first  # replacing the earlier plot is fine


@pytest.mark.parametrize("line", ['{"step": 1, "reward/mean": 1' + "0" * 400 + "}",
                                  '{"step": 1, "actor/kl": 1e308}\n{"step": 2, "actor/kl": 1e308}',
                                  '{"step": 1, "reward/mean": 1.79e308}\n{"step": 2, "reward/mean": -1.79e308}'])
def test_values_at_the_edge_of_float_range_do_not_crash(tmp_path, capsys, line):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(line + "\n")
    assert main(["plot", str(run)]) in (0, 2)  # drawn, or refused in one line; never a traceback
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_a_trip_cut_from_metrics_by_a_rollback_is_drawn_from_the_guard_record(tmp_path):
    """A rollback cuts metrics.jsonl back to the last good step, dropping the tripped row; the guard's record
    (checkpoints/guard.json) still names the step, so the plot marks it. A damaged record is ignored."""
    run = _write_run(tmp_path, _records(with_eval=False, with_monitor=True, steps=5))
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "guard.json").write_text(json.dumps({"trips": [{"step": 7, "detectors": ["kl_band"],
                                                                           "onset_step": 5}]}))
    from cluster.sinks.plot import run_data

    assert run_data(run).trips == (7,) and plot_run(run).is_file()
    (run / "checkpoints" / "guard.json").write_text("{broken")
    assert run_data(run).trips == ()
