"""A 2-step smoke of each sequence-level policy loss (``algorithm.policy_loss``: gspo, gspo_token, cispo) through the
real GRPO loop (``cluster.driver.GRPOJob``) on the in-process runtime: the tiny random Llama, two iterations per step
(so the second one's ratios differ from 1 and the loss's clip acts), KL to the reference policy, an entropy bonus,
held-out evaluation after each step. The job is scored by the test reward ``parity`` (tests/registered.py), which
gives groups unequal rewards. Selectable with ``-k "gspo or cispo"``; about 10 s per loss.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cluster.in_process import local_job
from tests.job_runs import run_to_end
from tests.local_runtime import local_spec
from tests.registered import parity_reward, temporarily_registered

#: Each loss with the clip bounds its source uses: GSPO's 3e-4 / 4e-4 (Zheng et al. 2025), CISPO's weight without a
#: lower bound (ε_low near 1) and clip-higher's 0.28 as the upper one.
LOSSES = {"gspo": {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4},
          "gspo_token": {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4},
          "cispo": {"clip_eps_low": 0.999, "clip_eps_high": 0.28}}


@pytest.fixture(scope="module")
def parity():
    yield from temporarily_registered("parity", parity_reward)


def _problems(path: Path, count: int, offset: int = 0) -> str:
    path.write_text("".join(json.dumps({"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}"}) + "\n"
                            for i in range(offset, offset + count)))
    return str(path)


@pytest.mark.parametrize("mode", list(LOSSES))
def test_two_steps_of_the_loop_train_with_the_policy_loss(mode, tiny_model_dir, parity, tmp_path):
    spec = local_spec(
        tiny_model_dir, str(tmp_path),
        data={"train_path": _problems(tmp_path / "train.jsonl", 8), "max_prompt_tokens": 256},
        algorithm={"policy_loss": mode, "num_iterations": 2, "kl_coef": 0.04, "entropy_coef": 0.01,
                   "rewards": {"parity": 1.0, "accuracy": 0.0, "format": 0.0}, **LOSSES[mode]},
        eval={"data_path": _problems(tmp_path / "held_out.jsonl", 3, offset=50), "every_steps": 1, "max_tokens": 6},
        metrics={"port": None}, checkpoint={"every_steps": 0, "save_final": False})
    history = run_to_end(local_job(spec, progress=False))
    assert [m["policy_version"] for m in history] == [1, 2]
    for m in history:
        assert m["sync/verified"] is True and m["actor/update_skipped"] == 0.0
        assert all(math.isfinite(m[k]) for k in ("actor/loss", "actor/grad_norm", "actor/kl", "actor/entropy"))
        # the second iteration's policy moved (lr 1e-3, and the KL and entropy terms move it on flat steps too)
        assert m["actor/ratio_mean"] != 1.0
    # the clip acts where an advantage is non-zero: a step whose groups are all flat (same parity for all G) has none
    assert any(m["actor/clip_fraction"] > 0.0 for m in history if m["groups/all_equal_fraction"] < 1.0)
    assert any(m["groups/all_equal_fraction"] < 1.0 for m in history)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["eval/problems"] == 3 for r in rows)
