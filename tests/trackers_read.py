"""Reading a run back through each tracker library's own reader (tests of ``cluster.sinks.trackers``).

- MLflow: ``MlflowClient`` (``search_runs``, ``get_metric_history``, ``list_artifacts``);
- TensorBoard: ``tensorboard.backend.event_processing.event_accumulator.EventAccumulator``;
- trackio: ``trackio.sqlite_storage.SQLiteStorage`` on its local database;
- wandb: the offline run file ``run-*.wandb`` — wandb 0.31 ships no Python reader for it any more, so the file's
  LevelDB-log framing (a ``:W&B`` header, 32 KiB blocks of ``crc32 (4) | length (2) | type (1)`` chunks, types 1
  full / 2 first / 3 middle / 4 last, as LevelDB's ``log_format.h``) is undone here and each record is parsed with
  wandb's own protobuf ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

WANDB_BLOCK = 32768
WANDB_HEADER = 7  # ":W&B", a 2-byte magic and a 1-byte version


def wandb_records(path: Path) -> list:
    """Every record (``wandb_internal_pb2.Record``) of an offline run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb run file (starts {data[:7]!r})"
    pos, pending, raw = WANDB_HEADER, b"", []
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            raw.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            raw.append(pending + chunk)
    records = []
    for blob in raw:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(blob)
        records.append(record)
    return records


def wandb_run(output_dir: Path) -> dict:
    """The offline run under ``output_dir/wandb``: ``{"history": [{key: value}], "config": {key: value},
    "files": [paths saved]}``."""
    files = sorted(output_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {output_dir / 'wandb'}, got {files}"
    out: dict = {"history": [], "config": {}, "files": []}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in record.history.item})
        elif kind == "run":
            out["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            out["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "files":
            out["files"] += [f.path for f in record.files.files]
    return out


def mlflow_run(tracking_uri: str, experiment: str) -> dict:
    """The one run of ``experiment``: ``{"run": Run, "history": {key: [(step, value)]}, "artifacts": [paths]}``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, f"expected one run, got {len(runs)}"
    run = runs[0]
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
               for key in run.data.metrics}
    return {"run": run, "history": history, "client": client,
            "artifacts": [a.path for a in client.list_artifacts(run.info.run_id)]}


def tensorboard_run(logdir: Path):
    """An ``EventAccumulator`` over ``logdir``, loaded (images and text kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def trackio_logs(project: str, run_name: str) -> list[dict]:
    """Every metrics row trackio stored for ``run_name`` of ``project`` (its local database)."""
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, run_name)


def wandb_tables(output_dir: Path, key: str) -> list[tuple[int, dict]]:
    """Every ``key`` table the offline run logged, as (its ``step`` metric, the table file wandb wrote:
    ``{"columns": [...], "data": [[...]]}``), in logging order. The history row names the file (``<key>/path``,
    relative to the run's ``files`` folder)."""
    run_dir = sorted(output_dir.glob("wandb/offline-run-*"))[0]
    return [(h["step"], json.loads((run_dir / "files" / h[f"{key}/path"]).read_text()))
            for h in wandb_run(output_dir)["history"] if h.get(f"{key}/_type") == "table-file"]


def mlflow_table(tracking_uri: str, experiment: str, artifact_file: str):
    """The table artifact ``artifact_file`` of the one run of ``experiment``, through MLflow's own reader
    (``MlflowClient.load_table``: a pandas DataFrame)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    return client.load_table(experiment_id, artifact_file)


def tensorboard_texts(acc, tag: str) -> list[tuple[int, str]]:
    """(step, Markdown text) of every text summary logged under ``tag``, from a loaded ``EventAccumulator``."""
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def trackio_tables(project: str, run_name: str, key: str) -> list[tuple[int, list[dict]]]:
    """(step, rows as dicts) of every ``trackio.Table`` logged under ``key`` (its local database)."""
    return [(int(r["step"]), r[key]["_value"]) for r in trackio_logs(project, run_name)
            if isinstance(r.get(key), dict) and r[key].get("_type") == "trackio.table"]
