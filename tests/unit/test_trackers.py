"""Experiment trackers (``metrics.trackers``, ``cluster.sinks.trackers``) on a real ``GRPOJob`` over the stand-in
fleet and trainer (no model work, a few seconds), each read back through its library's own reader
(``tests/trackers_read.py``): the same keys and values as ``metrics.jsonl``, the spec and git commit as the run's
configuration, the plot and the eval table as artifacts. A tracker whose library is missing is skipped. Then the
failure rules: a tracker that cannot reach its server, or that raises mid-run, warns once and the job trains to the
end; a tracker whose library is not installed is refused before the job starts, naming ``metrics.trackers``. Last, a
tracker added as one module and one registry line (docs/trackers.md) runs in a job."""

from __future__ import annotations

import contextlib
import io

import importlib.util
import json
from pathlib import Path

import pytest

from cluster.driver import GRPOJob
from cluster.sinks.samples import EVAL_COLUMNS as SAMPLE_EVAL_COLUMNS
from cluster.sinks.samples import TRAIN_COLUMNS, read_samples, samples_tables
from cluster.sinks.trackers import EVAL_COLUMNS, TRACKERS, TrackerSetupError
from cluster.sinks.trackers.tensorboard_tracker import TensorBoardTracker
from cluster.sinks.trackers.wandb_tracker import WandbTracker
from cluster.spec import load_spec_text
from tests.stand_ins import StandInFleet, StandInTrainer
from tests.trackers_read import (mlflow_run, mlflow_table, tensorboard_run, tensorboard_texts, trackio_logs,
                                 trackio_tables, wandb_run, wandb_tables)

MODULES = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard", "trackio": "trackio"}
INSTALLED = [name for name, module in MODULES.items() if importlib.util.find_spec(module) is not None]
STEPS = 3


def _spec(tmp_path: Path, model: str, trackers: list[str], metrics: str = ""):
    rows = "".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                   for i in range(8))
    (tmp_path / "train.jsonl").write_text(rows)
    return load_spec_text(
        f"name: tracked\noutput_dir: {tmp_path / 'out'}\ntotal_steps: {STEPS}\nmodel: {{path: {model}}}\n"
        f"data: {{train_path: {tmp_path / 'train.jsonl'}, test_path: {tmp_path / 'train.jsonl'}}}\n"
        f"rollout: {{prompts_per_step: 2, group_size: 2}}\neval: {{every_steps: 1, limit: 2}}\n"
        f"metrics: {{port: null, trackers: {json.dumps(trackers)}{metrics}}}\n")


def _run(spec) -> tuple[list[dict], list[str]]:
    """Run the job over the stand-ins; returns (metrics.jsonl rows, the job's status lines, where tracker warnings
    go)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):  # GRPOJob.status writes "[grpo-cluster] <message>" lines there
        job = GRPOJob(spec, fleet=StandInFleet(), trainer=StandInTrainer(), progress=False)
        try:
            job.run()
        finally:
            job.close()
    lines = [line.removeprefix("[grpo-cluster] ") for line in stderr.getvalue().splitlines()]
    out = Path(spec.output_dir)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], lines


@pytest.fixture(scope="module")
def tracked(tiny_model_dir, tmp_path_factory):
    if not INSTALLED:
        pytest.skip("no tracker library is installed (pip install -e '.[trackers]')")
    tmp = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRACKIO_DIR", str(tmp / "out" / "trackio"))  # trackio reads it when first imported
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("WANDB_MODE", raising=False)
        spec = _spec(tmp, tiny_model_dir, INSTALLED)
        rows, lines = _run(spec)
    return {"rows": rows, "lines": lines, "out": Path(spec.output_dir), "spec": spec}


def _steps(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]


def _same(got: list[tuple[int, float]], want: list[tuple[int, float]], rel: float = 1e-6) -> None:
    """Same steps, and values equal within ``rel`` (TensorBoard stores float32)."""
    assert [step for step, _ in got] == [step for step, _ in want]
    assert [value for _, value in got] == pytest.approx([value for _, value in want], rel=rel)


def _need(name: str) -> None:
    if name not in INSTALLED:
        pytest.skip(f"{name} is not installed")


def test_the_job_ran_with_every_installed_tracker_and_no_warning(tracked):
    assert [r["step"] for r in tracked["rows"]] == list(range(STEPS + 1))  # step 0: the starting weights' eval
    assert not [line for line in tracked["lines"] if "warning: tracker" in line], tracked["lines"]
    assert (tracked["out"] / "plot.png").is_file()


def test_mlflow_reads_back_the_metrics_config_and_artifacts(tracked):
    _need("mlflow")
    run = mlflow_run(f"sqlite:///{tracked['out'] / 'mlflow' / 'mlflow.db'}", "grpo-cluster")
    rows = tracked["rows"]
    for key in ("reward/mean", "policy_version", "eval/accuracy", "timing/step_s"):
        _same(sorted(run["history"][key]), _steps(rows, key))
    params = run["run"].data.params
    assert params["spec.total_steps"] == str(STEPS) and params["spec.name"] == "tracked"
    assert "git_commit" in params and run["run"].info.run_name == "tracked"
    assert {"plot.png", "eval_table.json", "spec.yaml"} <= set(run["artifacts"])
    local = run["client"].download_artifacts(run["run"].info.run_id, "eval_table.json")
    data = json.loads(Path(local).read_text())
    assert data["columns"] == list(EVAL_COLUMNS) and [r[0] for r in data["data"]] == list(range(STEPS + 1))


def test_tensorboard_reads_back_the_metrics_config_and_artifacts(tracked):
    _need("tensorboard")
    acc = tensorboard_run(tracked["out"] / "tensorboard")
    for key in ("reward/mean", "policy_version", "eval/accuracy", "timing/step_s"):
        _same([(e.step, e.value) for e in acc.Scalars(key)], _steps(tracked["rows"], key))
    assert "plot" in acc.Tags()["images"]
    tensors = acc.Tags()["tensors"]
    assert {"config/text_summary", "eval/table/text_summary", "spec/text_summary"} <= set(tensors)
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"git_commit"' in config and '"total_steps": 3' in config


def test_wandb_offline_run_file_holds_the_metrics_config_and_artifacts(tracked):
    _need("wandb")
    run = wandb_run(tracked["out"])
    for key in ("reward/mean", "timing/step_s"):
        _same([(h["step"], h[key]) for h in run["history"] if key in h], _steps(tracked["rows"], key))
    assert run["config"]["spec"]["total_steps"] == STEPS and "git_commit" in run["config"]
    final = run["history"][-1]  # the artifacts' row, logged at close (media files referenced by path)
    assert final["plot/_type"] == "image-file" and final["eval/table/_type"] == "table-file"
    assert final["eval/table/nrows"] == STEPS + 1 and final["eval/table/ncols"] == len(EVAL_COLUMNS)
    assert {final["plot/path"], final["eval/table/path"], "spec.yaml"} <= set(run["files"])


def test_trackio_local_database_holds_the_metrics_and_config(tracked):
    _need("trackio")
    logs = trackio_logs("grpo-cluster", "tracked")
    for key in ("reward/mean", "timing/step_s"):
        _same([(r["step"], r[key]) for r in logs if key in r], _steps(tracked["rows"], key))
    from trackio.sqlite_storage import SQLiteStorage

    config = SQLiteStorage.get_run_config("grpo-cluster", "tracked")
    assert config["spec"]["total_steps"] == STEPS and "git_commit" in config
    assert {"tracked-plot", "tracked-eval_table", "tracked-spec"} <= {
        a["name"] for arts in SQLiteStorage.get_run_artifacts("grpo-cluster", "tracked", None).values() for a in arts}


def _sample_tables(out: Path) -> dict[str, list[tuple[int, list[list]]]]:
    """samples.jsonl as the tracker tables of each step: table name → [(step, rows)], steps ascending."""
    records = read_samples(out / "samples.jsonl")
    tables: dict[str, list[tuple[int, list[list]]]] = {}
    for step in sorted({r["step"] for r in records}):
        for table in samples_tables([r for r in records if r["step"] == step]):
            tables.setdefault(table.name, []).append((step, table.as_lists()))
    return tables


def test_samples_tables_of_every_step_hold_each_completion(tracked):
    tables = _sample_tables(tracked["out"])
    assert [step for step, _ in tables["samples/train"]] == list(range(1, STEPS + 1))
    assert [step for step, _ in tables["samples/eval"]] == list(range(STEPS + 1))
    assert all(len(rows) == 4 for _, rows in tables["samples/train"])  # 2 groups x 2 completions
    assert all(len(rows) == 2 for _, rows in tables["samples/eval"])  # 2 held-out problems x 1 completion


def test_report_samples_tables_read_back_from_mlflow(tracked):
    _need("mlflow")
    uri = f"sqlite:///{tracked['out'] / 'mlflow' / 'mlflow.db'}"
    for name, columns in (("samples/train", TRAIN_COLUMNS), ("samples/eval", SAMPLE_EVAL_COLUMNS)):
        frame = mlflow_table(uri, "grpo-cluster", f"{name.replace('/', '_')}/steps_000000-000099.json")
        want = [row for _, rows in _sample_tables(tracked["out"])[name] for row in rows]
        assert list(frame.columns) == list(columns) and len(frame) == len(want)
        for column in ("step", "completion", "text", "finish_reason", "length"):
            assert frame[column].tolist() == [row[columns.index(column)] for row in want]


def test_report_samples_tables_read_back_from_tensorboard(tracked):
    _need("tensorboard")
    acc = tensorboard_run(tracked["out"] / "tensorboard")
    for name, columns in (("samples/train", TRAIN_COLUMNS), ("samples/eval", SAMPLE_EVAL_COLUMNS)):
        texts = tensorboard_texts(acc, name)
        want = _sample_tables(tracked["out"])[name]
        assert [step for step, _ in texts] == [step for step, _ in want]
        for (_, text), (_, rows) in zip(texts, want):
            header, rule, *lines = text.splitlines()
            assert header == " | ".join(columns) and len(lines) == len(rows)
            assert [line.split(" | ")[0] for line in lines] == [str(row[0]) for row in rows]


def test_report_samples_tables_read_back_from_wandb(tracked):
    _need("wandb")
    for name, columns in (("samples/train", TRAIN_COLUMNS), ("samples/eval", SAMPLE_EVAL_COLUMNS)):
        got = wandb_tables(tracked["out"], name)
        want = _sample_tables(tracked["out"])[name]
        assert [step for step, _ in got] == [step for step, _ in want]
        for (_, table), (_, rows) in zip(got, want):
            assert table["columns"] == list(columns) and table["data"] == rows


def test_report_samples_tables_read_back_from_trackio(tracked):
    _need("trackio")
    for name, columns in (("samples/train", TRAIN_COLUMNS), ("samples/eval", SAMPLE_EVAL_COLUMNS)):
        got = trackio_tables("grpo-cluster", "tracked", name)
        want = _sample_tables(tracked["out"])[name]
        assert [step for step, _ in got] == [step for step, _ in want]
        for (_, table), (_, rows) in zip(got, want):
            assert table == [dict(zip(columns, row)) for row in rows]


def test_unreachable_server_warns_once_and_training_goes_on(tmp_path, tiny_model_dir, monkeypatch):
    _need("mlflow")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    spec = _spec(tmp_path, tiny_model_dir, ["mlflow"], metrics=", mlflow_tracking_uri: 'http://127.0.0.1:9'")
    rows, lines = _run(spec)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    warnings = [line for line in lines if "tracker 'mlflow' failed" in line]
    assert len(warnings) == 1 and "starting the run" in warnings[0] and "training goes on" in warnings[0]


class _FailsAtStep2(TensorBoardTracker):
    """TensorBoard whose ``log`` raises at step 2 (a full disk, say)."""

    calls: list[int] = []

    def log(self, step, numbers):
        type(self).calls.append(step)
        if step == 2:
            raise OSError(28, "No space left on device")
        super().log(step, numbers)


def test_a_tracker_raising_mid_run_is_switched_off_after_one_warning(tmp_path, tiny_model_dir, monkeypatch):
    _need("tensorboard")
    monkeypatch.setitem(TRACKERS, "tensorboard", _FailsAtStep2)
    _FailsAtStep2.calls = []
    rows, lines = _run(_spec(tmp_path, tiny_model_dir, ["tensorboard"]))
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert _FailsAtStep2.calls == [0, 1, 2]  # nothing sent after the failure
    warnings = [line for line in lines if "tracker 'tensorboard' failed" in line]
    assert len(warnings) == 1 and "logging step 2" in warnings[0] and "No space left" in warnings[0]


def test_a_missing_library_is_refused_before_the_job_starts(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(WandbTracker, "package", "no_such_wandb_module")
    monkeypatch.setattr(WandbTracker, "install", "wandb (pip install x)")
    spec = _spec(tmp_path, tiny_model_dir, ["wandb"])
    with pytest.raises(TrackerSetupError, match=r"metrics\.trackers: 'wandb' needs the no_such_wandb_module"):
        GRPOJob(spec, fleet=StandInFleet(), trainer=StandInTrainer(), progress=False)
    assert not Path(spec.output_dir, "metrics.jsonl").exists()


_ONE_MODULE = '''
import json


class JsonLinesTracker:
    name, package, install = "jsonlines", "json", "nothing (the standard library)"

    def __init__(self, spec, output_dir):
        self.path = output_dir / "tracked.jsonl"

    def location(self):
        return str(self.path)

    def open(self, config):
        self.path.write_text(json.dumps({"config": config["spec"]["name"]}) + "\\n")

    def log(self, step, numbers):
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **numbers}) + "\\n")

    def artifacts(self, png, tables, spec_yaml):
        with self.path.open("a") as f:
            f.write(json.dumps({t.name: [list(t.columns), *map(list, t.rows)] for t in tables}) + "\\n")

    def close(self):
        pass
'''


def test_a_tracker_added_as_one_module_and_one_registry_line_runs_in_a_job(tmp_path, tiny_model_dir, monkeypatch):
    """docs/trackers.md, "Adding a tracker": a module of one's own and one registry line (``register_tracker`` with
    "module:Class"); the spec selects it by name, the job logs every step to it and gives it the eval table."""
    from cluster.sinks.trackers.registry import register_tracker
    from tests.registered import variant_registered

    (tmp_path / "my_tracker_module.py").write_text(_ONE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with variant_registered(TRACKERS, "jsonlines", lambda: register_tracker(
            "jsonlines", "my_tracker_module:JsonLinesTracker")):
        rows, lines = _run(_spec(tmp_path, tiny_model_dir, ["jsonlines"]))
    assert not [line for line in lines if "warning: tracker" in line], lines
    got = [json.loads(line) for line in (tmp_path / "out" / "tracked.jsonl").read_text().splitlines()]
    assert got[0] == {"config": "tracked"}
    assert [r["step"] for r in got[1:-1]] == [r["step"] for r in rows]
    _same([(r["step"], r["timing/step_s"]) for r in got[1:-1] if "timing/step_s" in r], _steps(rows, "timing/step_s"))
    columns, *table = got[-1]["eval/table"]
    assert columns == list(EVAL_COLUMNS) and [r[0] for r in table] == list(range(STEPS + 1))
