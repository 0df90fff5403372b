"""Job set-up fails fast, before any Ray worker starts, naming what is wrong: output folders, model paths, prompts
that are all too long, unreachable clusters and clusters without the resources the pools ask for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.data import DataError
from tests.stand_ins import stand_in_job
from cluster.data.models import ModelError, resolve_model_path
from cluster.loop.setup import SetupError
from cluster.ray_shell.pools import InsufficientResources, check_cluster_resources
from cluster.ray_shell.ray_init import reachable as _reachable
from cluster.spec import load_spec_text


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _spec(tmp_path, model, *overrides):
    text = f"output_dir: {tmp_path / 'out'}\ntotal_steps: 1\nmodel: {{path: {model}}}\n" \
           f"data: {{train_path: {_data(tmp_path)}}}\nmetrics: {{port: null}}\n"
    return load_spec_text(text, overrides=overrides)


def test_prompts_are_tokenized_once_and_counted(tmp_path, tiny_model_dir):
    job = stand_in_job(_spec(tmp_path, tiny_model_dir), progress=False)
    try:
        assert job.prompts_filtered == 0 and len(job.prompt_ids) == 5
        examples, requests = job.requests.draw(3, 4)
        assert [r.prompt_ids for r in requests] == [job.prompt_ids[e.index] for e in examples]
        assert (Path(job.spec.output_dir) / "spec.yaml").is_file()
    finally:
        job.close()


def test_all_prompts_too_long_is_a_data_error_not_a_hang(tmp_path, tiny_model_dir):
    with pytest.raises(DataError, match="all 5 prompts are longer than data.max_prompt_tokens=5"):
        stand_in_job(_spec(tmp_path, tiny_model_dir, "data.max_prompt_tokens=5"), progress=False)


def test_output_dir_that_is_a_file(tmp_path, tiny_model_dir):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SetupError, match="output_dir: cannot write to"):
        stand_in_job(_spec(tmp_path, tiny_model_dir, f"output_dir={blocker}"), progress=False)
    with pytest.raises(SetupError, match="checkpoint.dir: cannot write to"):
        stand_in_job(_spec(tmp_path, tiny_model_dir, f"checkpoint.dir={blocker}/sub"), progress=False)


def test_model_paths(tmp_path):
    with pytest.raises(ModelError, match="model folder .*nope not found"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="not a Hugging Face model folder"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelError, match="unknown builtin model"):
        resolve_model_path("builtin:Nope")
    assert resolve_model_path("org/some-model") == "org/some-model"  # a hub id is passed through


def test_model_folder_without_tokenizer(tmp_path, tiny_model_dir):
    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text((Path(tiny_model_dir) / "config.json").read_text())
    with pytest.raises(ModelError, match="cannot load a tokenizer"):
        stand_in_job(_spec(tmp_path, folder), progress=False)


def test_missing_resources_are_listed(monkeypatch, tmp_path):
    import ray

    spec = _spec(tmp_path, "org/m", "rollout.num_gpus_per_replica=1", "train.num_gpus_per_worker=1",
                 "train.world_size=2", "train.num_cpus_per_worker=1", "ray.num_cpus=null")
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(InsufficientResources) as err:
        check_cluster_resources(spec)
    message = str(err.value)
    assert "needs CPU 3 (rollout 1 x 1 + train 2 x 1), cluster has 2" in message
    assert "needs GPU 3 (rollout 1 x 1 + train 2 x 1), cluster has 0" in message
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 4.0})
    check_cluster_resources(spec)


def test_reachable_probes_host_port_addresses():
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert _reachable(f"127.0.0.1:{port}", timeout_s=1)
    assert not _reachable(f"127.0.0.1:{port}", timeout_s=1)  # the same port once nothing listens on it


def test_unreachable_address_fails_fast(tmp_path, capsys):
    assert not _reachable("127.0.0.1:1", timeout_s=1)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"output_dir: {tmp_path / 'o'}\ntotal_steps: 1\ndata: {{train_path: {_data(tmp_path)}}}\n")
    assert main(["run", str(spec), "--address", "127.0.0.1:1"]) == 2
    assert "cannot reach a Ray cluster at 127.0.0.1:1" in capsys.readouterr().err


def test_eval_bad_input_exit_code(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "missing"), "--data", str(_data(tmp_path))]) == 2
    assert "not found" in capsys.readouterr().err
