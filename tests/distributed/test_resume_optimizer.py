"""Resume with changed optimizer settings (issue 12, section 2): the run uses what it reports.

A checkpoint saved at ``train.lr=1e-6`` and resumed with ``train.lr=5e-7`` (and other betas, weight decay, and an
``eps`` edited in the saved ``param_groups.json``) trains with the new values — ``actor/lr`` and the optimizer's
``param_groups`` agree — while AdamW's moments and step count are restored exactly. One gloo rank, the real worker.
"""

from __future__ import annotations

import json
import os

import torch

from tests.distributed.test_fsdp_parity import MAX_RESPONSE_TOKENS, TEMPERATURE, N, make_batch, pack
from weight_sync.group import free_port


def _worker(model_dir: str, policy_path: str | None = None, **train):
    from cluster.spec import AlgorithmSpec, TrainSpec
    from train_workers.fsdp_worker import FSDPTrainWorker

    spec = TrainSpec(world_size=1, num_threads=2, timeout_s=120, **train)
    worker = FSDPTrainWorker(0, 1, model_dir, spec, AlgorithmSpec(kl_coef=0.0), TEMPERATURE, MAX_RESPONSE_TOKENS)
    worker.init_distributed("127.0.0.1", free_port(), policy_path)
    return worker


def _moments(worker) -> dict[str, torch.Tensor]:
    from train_workers.sharding import full_tensor

    names = {id(p): n for n, p in worker.policy.named_parameters()}
    return {f"{names[id(p)]}::{k}": (full_tensor(v) if v.dim() else v).detach().clone()
            for p, state in worker.optimizer.state.items() for k, v in state.items()}


def test_resume_applies_the_new_optimizer_settings_and_keeps_the_moments(tiny_model_dir, tmp_path):
    num_tokens = sum(len(r) for r in make_batch()[1])
    saved = _worker(tiny_model_dir, lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    try:
        saved.train_step([pack(list(range(N)))], num_tokens, N)
        ckpt = str(tmp_path / "ckpt")
        saved.save_checkpoint(ckpt)
        moments = _moments(saved)
    finally:
        saved.shutdown()
    groups_path = os.path.join(ckpt, "optimizer", "param_groups.json")
    with open(groups_path) as f:
        groups = json.load(f)
    assert groups[0]["lr"] == 1e-6 and groups[0]["eps"] == 1e-8
    groups[0]["eps"] = 1e-6  # a field the spec does not expose is also the running one's, not the file's
    with open(groups_path, "w") as f:
        json.dump(groups, f)

    resumed = _worker(tiny_model_dir, ckpt, lr=5e-7, betas=(0.8, 0.99), weight_decay=0.01)
    try:
        changed = resumed.load_checkpoint(ckpt, 1)
        group = resumed.optimizer.param_groups[0]
        assert group["lr"] == 5e-7 and tuple(group["betas"]) == (0.8, 0.99)
        assert group["weight_decay"] == 0.01 and group["eps"] == 1e-8
        assert changed == {"lr": (1e-6, 5e-7), "betas": ((0.9, 0.999), (0.8, 0.99)), "weight_decay": (0.0, 0.01),
                           "eps": (1e-6, 1e-8)}
        restored = _moments(resumed)
        assert restored.keys() == moments.keys() and len(moments) > 0
        for key, value in moments.items():
            assert torch.equal(restored[key], value), key
        result = resumed.train_step([pack(list(range(N)))], num_tokens, N)
        assert result.metrics["actor/lr"] == resumed.optimizer.param_groups[0]["lr"] == 5e-7
        assert result.policy_version == 2
    finally:
        resumed.shutdown()


def test_resume_with_the_same_settings_reports_no_change(tiny_model_dir, tmp_path):
    saved = _worker(tiny_model_dir, lr=1e-6)
    try:
        saved.train_step([pack([0, 1])], 12, 2)
        saved.save_checkpoint(str(tmp_path / "ckpt"))
    finally:
        saved.shutdown()
    resumed = _worker(tiny_model_dir, str(tmp_path / "ckpt"), lr=1e-6)
    try:
        assert resumed.load_checkpoint(str(tmp_path / "ckpt"), 1) == {}
        assert resumed.optimizer.param_groups[0]["lr"] == 1e-6
    finally:
        resumed.shutdown()
