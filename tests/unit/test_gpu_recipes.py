"""The GPU recipes (issue #29): ``examples/gpu_1x_qwen0.5b_gsm8k.yaml`` (one GPU), ``examples/gpu_8x_qwen7b_gsm8k.yaml``
(one 8-GPU node) and the KubeRay overlay ``deploy/k8s/overlays/qwen7b-2node`` (two 8-GPU nodes). None has run on a GPU
here, and each says so; what CI checks: each spec validates against ``cluster/spec``, its GPU reservations fit the
machine it is written for (Ray must be able to place every engine and rank), tensor-parallel engines reserve one GPU
per TP rank, and the overlay's RayCluster has the GPUs its spec reserves, group by group. (``tests/unit/test_deploy.py``
validates the rendered overlay against the Kubernetes schemas and the KubeRay CRDs.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from cluster.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
ONE_GPU = ROOT / "examples" / "gpu_1x_qwen0.5b_gsm8k.yaml"
ONE_NODE = ROOT / "examples" / "gpu_8x_qwen7b_gsm8k.yaml"
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "qwen7b-2node"
NOT_RUN = "has not run on a GPU here"


def _gpus(spec) -> tuple[float, float]:
    """(GPUs the rollout engines reserve, GPUs the train ranks reserve)."""
    r, t = spec.rollout, spec.train
    return r.replicas * r.num_gpus_per_replica, t.world_size * t.num_gpus_per_worker


@pytest.mark.parametrize("path", [ONE_GPU, ONE_NODE, OVERLAY / "spec.yaml", OVERLAY / "kustomization.yaml"])
def test_every_recipe_says_it_has_not_run_on_a_gpu(path):
    assert NOT_RUN in path.read_text(), f"{path} must state that it {NOT_RUN}"


@pytest.mark.parametrize("path", [ONE_GPU, ONE_NODE, OVERLAY / "spec.yaml"])
def test_recipe_specs_validate_and_use_the_gpu_knobs(path):
    spec = load_spec(path)
    assert spec.model.dtype == "bfloat16" and spec.model.path.startswith("Qwen/Qwen2.5-")
    assert spec.train.activation_checkpointing and spec.train.lr_schedule == "cosine"
    assert spec.train.num_gpus_per_worker > 0 and spec.rollout.num_gpus_per_replica > 0
    tp = spec.rollout.tensor_parallel_size
    if tp > 1:  # one whole GPU per tensor-parallel rank of an engine
        assert spec.rollout.num_gpus_per_replica == tp


def test_one_gpu_recipe_fits_one_gpu_with_room_for_both_pools():
    spec = load_spec(ONE_GPU)
    rollout, train = _gpus(spec)
    assert rollout + train <= 1.0 and spec.rollout.replicas == spec.train.world_size == 1
    assert spec.rollout.gpu_memory_utilization <= 1.0 - train  # the engine leaves the train rank its share
    assert "0.5B" in spec.model.path


def test_one_node_recipe_fits_eight_gpus():
    spec = load_spec(ONE_NODE)
    rollout, train = _gpus(spec)
    assert rollout + train == 8 and "7B" in spec.model.path and spec.rollout.tensor_parallel_size == 2


@pytest.mark.skipif(shutil.which("kubectl") is None and shutil.which("kustomize") is None,
                    reason="needs kubectl or kustomize to render overlays")
def test_two_node_overlay_has_the_gpus_its_spec_reserves():
    from tests.deploy_checks import render_kustomization

    objects = render_kustomization(OVERLAY)
    cluster = next(o for o in objects if o["kind"] == "RayCluster")
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    spec_text = config["data"]["spec.yaml"]
    assert yaml.safe_load(spec_text) == yaml.safe_load((OVERLAY / "spec.yaml").read_text())
    spec = load_spec(OVERLAY / "spec.yaml")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}

    def gpus(group: str) -> int:
        g = groups[group]
        per_pod = int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        return per_pod * g["maxReplicas"]

    rollout, train = _gpus(spec)
    assert (rollout, train) == (8, 8) and gpus("rollout") == rollout and gpus("train") == train
    assert spec.output_dir.startswith("/runs/") and "7B" in spec.model.path
