"""The off-policy default on the real loop (issue 30, item 2): ``rollout.mode: one_step_off`` on the in-process
runtime (tiny random Llama, ``parity`` reward, lr 1e-2 so one update moves the policy), 3 steps, with the default
(token-level TIS, cap 2, against the engine's logprobs) and with ``algorithm.off_policy_correction: none`` (≈ 20 s).

Both runs sample the same batches (same seeds, same weights: step 2's batch is generated on version 0 while step 1
trains, so it is one version stale when trained). Step 1 is on-policy (ratios 1 up to round-off), so both runs take
the same update; from step 2 the default's weights min(π_prox/π_b, 2) differ from 1 and the update differs. Without a
correction the gap is still measured (``actor/kl_behaviour_current``, ratio range) and the job warns at start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.in_process import local_job
from tests.job_runs import stopped_after
from tests.local_runtime import local_spec
from tests.registered import parity_reward, temporarily_registered

GAP_KEYS = ("actor/kl_behaviour_current", "actor/behaviour_ratio_min", "actor/behaviour_ratio_max")


@pytest.fixture(scope="module")
def parity():
    yield from temporarily_registered("parity", parity_reward)


def _run(model_dir: str, out: Path, **algorithm) -> list[dict]:
    out.mkdir(parents=True)
    data = out / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}"}) + "\n"
                            for i in range(8)))
    spec = local_spec(model_dir, str(out), total_steps=3,
                      data={"train_path": str(data), "max_prompt_tokens": 256, "shuffle": False},
                      rollout={"mode": "one_step_off", "max_staleness": 1},
                      train={"lr": 1e-2}, metrics={"port": None},
                      algorithm={"kl_coef": 0.0, "rewards": {"parity": 1.0, "accuracy": 0.0, "format": 0.0},
                                 **algorithm},
                      checkpoint={"every_steps": 0, "save_final": False})
    with stopped_after(local_job(spec, progress=False)) as job:
        return job.run()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, parity, tmp_path_factory):
    root = tmp_path_factory.mktemp("off_policy_default")
    return {"auto": _run(tiny_model_dir, root / "auto"),
            "none": _run(tiny_model_dir, root / "none", off_policy_correction="none")}


def test_the_default_weights_stale_tokens_by_their_truncated_ratio(runs):
    auto = runs["auto"]
    assert [m["policy_version"] for m in auto] == [1, 2, 3]
    for m in auto:
        assert all(k in m for k in GAP_KEYS)
        assert 0 < m["actor/tis_weight_mean"] <= 2.0
    assert auto[0]["rollout/logprob_diff"] < 2e-5 and abs(auto[0]["actor/tis_weight_mean"] - 1) < 1e-4  # on-policy
    stale = auto[1:]
    assert all(m["rollout/logprob_diff"] > 1e-3 and m["actor/kl_behaviour_current"] > 1e-6 for m in stale), stale
    assert all(abs(m["actor/tis_weight_mean"] - 1) > 1e-4 for m in stale)
    assert all(m["actor/behaviour_ratio_min"] < 1 < m["actor/behaviour_ratio_max"] for m in stale)


def test_none_trains_stale_tokens_unweighted_but_measures_the_gap(runs):
    auto, none = runs["auto"], runs["none"]
    assert all("actor/tis_weight_mean" not in m for m in none)
    assert all(all(k in m for k in GAP_KEYS) for m in none)
    # the same batches: step 1 on-policy, identical updates; step 2's stale batch weighted by the default only
    assert none[0]["actor/loss"] == pytest.approx(auto[0]["actor/loss"], abs=1e-6)
    assert none[1]["rollout/logprob_diff"] == pytest.approx(auto[1]["rollout/logprob_diff"], rel=1e-4)
    assert abs(none[1]["actor/loss"] - auto[1]["actor/loss"]) > 1e-4, (none[1]["actor/loss"], auto[1]["actor/loss"])


def test_none_is_warned_about_at_start(tiny_model_dir, parity, tmp_path, capsys):
    _run(tiny_model_dir, tmp_path / "warned", off_policy_correction="none")
    assert "warning: algorithm.off_policy_correction: none with rollout.mode one_step_off" in capsys.readouterr().err
