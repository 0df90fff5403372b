"""LoRA syncs that cannot silently fail (issue 30, item 3), on the real loop in process (tiny random Llama, LoRA rank
4 on every linear layer: 2 layers × 7 = 14 modules, ``parity`` reward, 2 steps; ≈ 10 s per job).

- ``sync: adapter``: after every sync the fleet reports how many modules the adapter is bound to (read from PEFT),
  checked against the trainer's 14 targets (``sync/adapter_modules``). A fleet whose adapter binds nothing (adapters
  switched off: what an engine serving the base looks like) or binds 13 of 14 stops the job at the first sync, naming
  the modules. A frozen adapter (the optimizer does not move it: lr 0 in its param groups) stops the job at the
  second sync: the payload's checksum did not change after an update with a non-zero gradient.
- ``sync: merged`` in bfloat16 with a small lr: the update's rounding is measured every sync
  (``sync/merge_rounding_error``, ``sync/merge_update_error``) and the job warns; in float32 it is tiny.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.in_process import LocalFleet, LocalTrainer
from cluster.driver import GRPOJob
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec
from tests.registered import parity_reward, temporarily_registered
from weight_sync.verify import AdapterSyncError

LORA = {"rank": 4, "alpha": 8.0}
TARGETS = 14  # q, k, v, o, gate, up, down in each of the tiny model's 2 layers


@pytest.fixture(scope="module")
def parity():
    yield from temporarily_registered("parity", parity_reward)


def _spec(model_dir: str, out: Path, lora: dict, lr: float = 1e-2, dtype: str = "float32", steps: int = 2):
    out.mkdir(parents=True, exist_ok=True)
    data = out / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}"}) + "\n"
                            for i in range(8)))
    return local_spec(model_dir, str(out), total_steps=steps, model={"path": model_dir, "dtype": dtype},
                      data={"train_path": str(data), "max_prompt_tokens": 256},
                      train={"lr": lr, "lora": {**LORA, **lora}}, metrics={"port": None},
                      algorithm={"kl_coef": 0.0, "rewards": {"parity": 1.0, "accuracy": 0.0, "format": 0.0}},
                      checkpoint={"every_steps": 0, "save_final": False})


def _run(spec, fleet_cls=LocalFleet, trainer_cls=LocalTrainer) -> list[dict]:
    with stopped_after(GRPOJob(spec, fleet=fleet_cls(spec), trainer=trainer_cls(spec), progress=False)) as job:
        return job.run()


def test_adapter_sync_reports_the_modules_it_bound(tiny_model_dir, parity, tmp_path):
    history = _run(_spec(tiny_model_dir, tmp_path, {"sync": "adapter"}))
    assert [m["policy_version"] for m in history] == [1, 2]
    assert all(m["sync/adapter_modules"] == TARGETS and m["sync/verified"] for m in history)
    assert all("sync/merge_rounding_error" not in m for m in history)


class UnboundFleet(LocalFleet):
    """A fleet whose PEFT model serves the base: its adapter layers are switched off after start (as an engine whose
    LoRA modules do not match the adapter's names serves the base, without an error)."""

    def start(self, *args, **kwargs):
        super().start(*args, **kwargs)
        self.model.base_model.disable_adapter_layers()


class OneUnboundFleet(LocalFleet):
    """A fleet whose adapter is switched off in one module (``model.layers.1.mlp.down_proj``)."""

    def start(self, *args, **kwargs):
        super().start(*args, **kwargs)
        self.model.get_submodule("base_model.model.model.layers.1.mlp.down_proj").enable_adapters(False)


@pytest.mark.parametrize("fleet_cls, bound, named", [
    (UnboundFleet, 0, "model.layers.0.mlp.down_proj"), (OneUnboundFleet, 13, "model.layers.1.mlp.down_proj")])
def test_an_adapter_bound_to_other_modules_stops_the_job_naming_them(tiny_model_dir, parity, tmp_path, fleet_cls,
                                                                      bound, named):
    spec = _spec(tiny_model_dir, tmp_path, {"sync": "adapter"})
    with pytest.raises(AdapterSyncError) as err:
        _run(spec, fleet_cls=fleet_cls)
    message = str(err.value)
    assert f"bound to {bound} module(s), the trainer targets {TARGETS}" in message and named in message
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == []  # stopped in step 1's sync: no step completed


class FrozenAdapterTrainer(LocalTrainer):
    """A train rank whose optimizer never moves the adapters (lr 0 in every param group): gradients are computed
    and reported, the policy version advances, the adapters stay as they are."""

    def start(self, *args, **kwargs):
        super().start(*args, **kwargs)
        for group in self.worker.optimizer.param_groups:
            group["lr"] = 0.0


def test_a_frozen_adapter_stops_the_job_at_its_second_sync(tiny_model_dir, parity, tmp_path):
    spec = _spec(tiny_model_dir, tmp_path, {"sync": "adapter"}, steps=3)
    with pytest.raises(AdapterSyncError, match=r"policy version 2: the LoRA adapter payload .* is the same as version "
                                               r"1's although the step applied an update with gradient norm"):
        _run(spec, trainer_cls=FrozenAdapterTrainer)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["actor/grad_norm"] > 0


def test_merged_sync_measures_the_rounding_and_warns_in_bfloat16(tiny_model_dir, parity, tmp_path, capsys):
    fp32 = _run(_spec(tiny_model_dir, tmp_path / "fp32", {"sync": "merged"}, lr=1e-4))
    assert all(m["sync/merge_update_error"] < 1e-2 for m in fp32)
    assert "merged LoRA weights" not in capsys.readouterr().err
    bf16 = _run(_spec(tiny_model_dir, tmp_path / "bf16", {"sync": "merged"}, lr=1e-4, dtype="bfloat16"))
    assert all(m["sync/merge_update_error"] > 0.5 and m["sync/merge_rounding_error"] > 0.5 for m in bf16)
    err = capsys.readouterr().err
    assert "warning: policy version 1: the merged LoRA weights the engines received lose" in err
    assert "use train.lora.sync: adapter" in err and err.count("merged LoRA weights") == 1  # once per job
