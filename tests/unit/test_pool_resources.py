"""Custom Ray resources per pool (``rollout.resources``, ``train.resources``): spec validation naming file, line and
field; the cluster-resource check counting them; and the weight-sync transport chosen from Ray node ids."""

from __future__ import annotations

import pytest
import ray

from cluster.ray_shell.pools import InsufficientResources, check_cluster_resources
from cluster.spec import SpecError, load_spec_text, spec_to_yaml
from weight_sync.transport import choose_transport

MINIMAL = "output_dir: runs/test\ntotal_steps: 3\ndata:\n  train_path: train.jsonl\n"


def _load(extra: str = "", *overrides: str):
    return load_spec_text(MINIMAL + extra, source="job.yaml", overrides=overrides)


def test_resources_default_to_none_and_load_from_yaml_and_set():
    assert _load().rollout.resources == {} and _load().train.resources == {}
    spec = _load("rollout:\n  resources: {rollout_node: 1}\ntrain:\n  resources:\n    train_node: 0.5\n")
    assert spec.rollout.resources == {"rollout_node": 1.0} and spec.train.resources == {"train_node": 0.5}
    spec = _load("", "train.resources.train_node=2", "rollout.resources={a: 0.25, b: 3}")
    assert spec.train.resources == {"train_node": 2.0} and spec.rollout.resources == {"a": 0.25, "b": 3.0}
    assert load_spec_text(spec_to_yaml(spec)) == spec


@pytest.mark.parametrize("value, line, message", [
    ("{CPU: 1}", "job.yaml:7: rollout.resources: resource 'CPU' is one of Ray's builtin resources: set "
                 "rollout.num_cpus_per_replica instead", None),
    ("{gpu: 1}", "job.yaml:7: rollout.resources: resource 'gpu' is one of Ray's builtin resources: set "
                 "rollout.num_gpus_per_replica instead", None),
    ("{memory: 1000}", "job.yaml:7: rollout.resources: resource 'memory' is one of Ray's builtin resources: it "
                       "cannot be reserved per pool", None),
    ("{node_a: 0}", "job.yaml:7: rollout.resources: resource 'node_a': expected an amount in (0, 1e+06], got 0.0",
     None),
    ("{node_a: -1}", "expected an amount in (0, 1e+06], got -1.0", None),
    ("{node_a: 2000000}", "expected an amount in (0, 1e+06], got 2000000.0", None),
    ("{node_a: 0.00001}", "resource 'node_a': expected a multiple of 0.0001 (Ray's resource unit), got 1e-05", None),
    ("{node_a: 1.0e-11}", "resource 'node_a': expected a multiple of 0.0001 (Ray's resource unit), got 1e-11", None),
    ("{node_a: 0.00004}", "resource 'node_a': expected a multiple of 0.0001 (Ray's resource unit), got 4e-05", None),
    ("{node_a: .nan}", "rollout.resources.node_a", "finite"),
    ("{node_a: '1'}", "rollout.resources.node_a", "valid number"),
    ("{node_a: true}", "rollout.resources.node_a", "valid number"),
    ("{'node a': 1}", "resource name 'node a': expected a non-empty name without whitespace", None),
    ("{'': 1}", "resource name '': expected a non-empty name without whitespace", None),
    ("[node_a]", "rollout.resources: Input should be a valid dictionary", None),
])
def test_bad_rollout_resources_name_the_field(value, line, message):
    with pytest.raises(SpecError) as info:
        _load(f"rollout:\n  replicas: 1\n  resources: {value}\n")
    text = str(info.value)
    assert line in text and "1 problem" in text, text
    if message:
        assert message in text, text


def test_bad_train_resources_name_the_field_and_override():
    with pytest.raises(SpecError, match=r"--set train.resources.GPU: train.resources: resource 'GPU' is one of "
                                        r"Ray's builtin resources: set train.num_gpus_per_worker instead"):
        _load("", "train.resources.GPU=1")


def test_cluster_check_counts_custom_resources(monkeypatch):
    spec = _load("", "rollout.replicas=2", "train.world_size=2", "train.num_cpus_per_worker=0.5",
                 "rollout.resources={rollout_node: 1, shared: 0.25}", "train.resources={train_node: 1, shared: 0.5}")
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0, "train_node": 2.0, "shared": 1.0})
    with pytest.raises(InsufficientResources) as info:
        check_cluster_resources(spec)
    text = str(info.value)
    # rollout 2 x 1 of rollout_node, which no node advertises; shared: 2 x 0.25 + 2 x 0.5 = 1.5 > 1
    assert "needs rollout_node 2 (rollout 2 x 1), cluster has 0" in text, text
    assert "needs shared 1.5 (rollout 2 x 0.25 + train 2 x 0.5), cluster has 1" in text, text
    assert "train_node" not in text and "CPU" not in text
    monkeypatch.setattr(ray, "cluster_resources",
                        lambda: {"CPU": 4.0, "train_node": 2.0, "shared": 1.5, "rollout_node": 2.0})
    check_cluster_resources(spec)


@pytest.mark.parametrize("mode, on_gpu, trainer, engines, expected", [
    ("broadcast", False, "n1", ["n1"], "broadcast"),
    ("auto", False, "n1", ["n1", "n1"], "shm"),
    ("auto", True, "n1", ["n1"], "cuda_ipc"),
    ("auto", False, "n1", ["n1", "n2"], "broadcast"),  # one engine on another node: every engine uses broadcast
    ("auto", True, "n1", ["n2"], "broadcast"),
    ("auto", False, None, ["n1"], "broadcast"),  # unknown trainer node: never assume a shared host
    ("auto", False, "n1", [None], "broadcast"),
    ("ipc", False, "n1", ["n1"], "shm"),
    ("ipc", True, "n1", ["n1", "n1"], "cuda_ipc"),
])
def test_transport_follows_node_ids(mode, on_gpu, trainer, engines, expected):
    assert choose_transport(mode, on_gpu, trainer, engines) == expected


def test_ipc_across_nodes_is_refused_naming_the_engine():
    with pytest.raises(ValueError, match=r"sync.mode=ipc needs every engine on train rank 0's Ray node aaaaaaaa, but "
                                         r"engine 1 on node bbbbbbbb; use sync.mode 'broadcast' or 'auto'"):
        choose_transport("ipc", False, "a" * 56, ["a" * 56, "b" * 56])


def test_where_names_each_engine_node_and_its_state(monkeypatch):
    from cluster.ray_shell.pools import _fmt_resources
    from cluster.ray_shell.rollout_pool import RolloutPool
    from contract.messages import EngineInfo

    pool = RolloutPool.__new__(RolloutPool)  # only ``infos`` is read: no engines are started
    pool.infos = [EngineInfo(policy_version=0, pid=1, node_id=node) for node in ("a" * 56, "b" * 56, "c" * 56, None)]
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"NodeID": "a" * 56, "Alive": False, "NodeManagerAddress": "10.0.0.7"},
        {"NodeID": "b" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.8"}])
    assert pool.where([0, 1, 2, 3]) == (
        "engine 0 on node aaaaaaaa (10.0.0.7, node dead); engine 1 on node bbbbbbbb (10.0.0.8, node still reported "
        "alive); engine 2 on node cccccccc (?, node dead); engine 3 on an unknown node")
    assert _fmt_resources({"CPU": 0.0, "memory": 2**30 * 22.94, "node:10.0.0.7": 1.0}, {"CPU", "rollout_node"}) == \
        "CPU 0, memory 22.9 GiB, rollout_node 0"


def test_exponent_floats_without_a_dot_are_numbers():
    """PyYAML (YAML 1.1) reads ``1e-3`` as the string '1e-3', which the strict amounts refused as "not a valid
    number"; the spec reads it as YAML 1.2 and JSON do, in the file and in --set."""
    spec = _load("rollout:\n  resources: {node_a: 1e-3}\ntrain:\n  lr: 5e-7\n", "train.resources={b: 2E0}")
    assert spec.rollout.resources == {"node_a": 0.001} and spec.train.resources == {"b": 2.0}
    assert spec.train.lr == 5e-7
    with pytest.raises(SpecError, match=r"rollout.top_k: Input should be a valid integer"):
        _load("", "rollout.top_k=1e3")  # an exponent float is still no integer



def test_strings_that_look_like_exponent_floats_round_trip():
    """A quoted "1e5" stays a string, and spec_to_yaml quotes it so that it reads back as one (a resumed job reloads
    the spec it saved)."""
    spec = load_spec_text("name: '2E3'\noutput_dir: '1e5'\ntotal_steps: 3\ndata:\n  train_path: t.jsonl\n")
    assert (spec.name, spec.output_dir) == ("2E3", "1e5")
    text = spec_to_yaml(spec)
    assert "name: '2E3'" in text and "output_dir: '1e5'" in text
    assert load_spec_text(text) == spec
