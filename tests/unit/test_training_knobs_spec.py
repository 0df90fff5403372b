"""The training knobs of issue #29 in the spec and their pure parts: ``train.lr_schedule`` / ``warmup_steps`` /
``warmup_ratio`` / ``min_lr_ratio`` (:class:`cluster.loop.lr_schedule.LRSchedule`, values computed by hand),
``train.activation_checkpointing`` / ``cpu_offload`` (FSDP2 only), ``model.revision`` / ``trust_remote_code``
(:class:`contract.model_source.ModelSource`) and ``metrics.trackers``."""

from __future__ import annotations

import math

import pytest

from cluster.loop.lr_schedule import LRSchedule
from cluster.spec import SpecError, load_spec_text
from contract.model_source import ModelSource

BASE = "output_dir: /tmp/knobs\ntotal_steps: 10\ndata: {train_path: /tmp/x.jsonl}\n"


def _spec(extra: str = ""):
    return load_spec_text(BASE + extra)


def test_constant_without_warmup_is_the_spec_lr_and_needs_no_call():
    s = LRSchedule(base_lr=1e-6, total_steps=10)
    assert not s.varies and [s.lr(k) for k in (1, 5, 10)] == [1e-6] * 3


def test_warmup_rises_linearly_and_never_trains_at_zero():
    s = LRSchedule(base_lr=1.0, kind="constant", warmup_steps=4, total_steps=10)
    assert s.varies and [s.lr(k) for k in range(1, 7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_and_cosine_decay_by_hand():
    # W = 2, T = 6: steps 3..6 have progress p = 0, 1/4, 2/4, 3/4
    lin = LRSchedule(base_lr=2.0, kind="linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.5)
    assert [lin.lr(k) for k in range(1, 7)] == pytest.approx([1.0, 2.0, 2.0, 1.75, 1.5, 1.25])
    cos = LRSchedule(base_lr=1.0, kind="cosine", warmup_steps=0, total_steps=4)
    expected = [0.5 * (1 + math.cos(math.pi * p)) for p in (0, 0.25, 0.5, 0.75)]
    assert [cos.lr(k) for k in range(1, 5)] == pytest.approx(expected)
    assert cos.lr(4) > 0  # the floor (0 here) is reached after the last step, not at it


def test_schedule_from_spec_resolves_the_warmup_ratio():
    spec = _spec("train: {lr: 0.001, lr_schedule: linear, warmup_ratio: 0.25}")
    s = LRSchedule.from_spec(spec.train, spec.total_steps)
    assert (s.kind, s.warmup_steps, s.base_lr) == ("linear", 2, 0.001)  # round(0.25 * 10) = 2
    with pytest.raises(ValueError, match="counted from 1"):
        s.lr(0)


@pytest.mark.parametrize("extra, field", [
    ("train: {warmup_steps: 2, warmup_ratio: 0.1}", "train.warmup_ratio"),
    ("train: {warmup_steps: 11}", "train.warmup_steps"),
    ("train: {lr_schedule: exponential}", "train.lr_schedule"),
    ("train: {strategy: megatron, activation_checkpointing: true}", "train.activation_checkpointing"),
    ("train: {strategy: megatron, cpu_offload: true}", "train.cpu_offload"),
    ("metrics: {trackers: [wandb, wandb]}", "metrics.trackers"),
    ("metrics: {trackers: [neptune]}", "metrics.trackers"),
    ("model: {trust_remote_code: 'yes'}", "model.trust_remote_code"),
])
def test_bad_knobs_are_refused_naming_the_field(extra, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        _spec(extra)


def test_defaults_are_off():
    spec = _spec()
    t, m = spec.train, spec.model
    assert (t.lr_schedule, t.warmup_steps, t.warmup_ratio, t.activation_checkpointing, t.cpu_offload) == (
        "constant", 0, None, False, False)
    assert (m.revision, m.trust_remote_code, spec.metrics.trackers) == (None, False, [])


def test_model_source_passes_revision_for_hub_ids_only(tmp_path):
    from rollout_workers.vllm.config import source_kwargs

    source = ModelSource.of(_spec("model: {revision: v1.2, trust_remote_code: true}").model)
    assert source.hf_kwargs("org/name") == {"trust_remote_code": True, "revision": "v1.2"}
    assert source_kwargs(source, "org/name") == {"trust_remote_code": True, "revision": "v1.2",
                                                 "tokenizer_revision": "v1.2"}
    assert source.hf_kwargs(str(tmp_path)) == {"trust_remote_code": True}  # a local folder is its own revision
    assert ModelSource().hf_kwargs("org/name") == {"trust_remote_code": False}
