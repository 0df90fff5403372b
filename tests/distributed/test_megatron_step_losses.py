"""FSDP2 / Megatron-core parity of one GRPO step for each sequence-level policy loss (``algorithm.policy_loss``:
gspo, gspo_token, cispo), GPU-free, on tests/distributed/test_megatron_step.py's model, batch and worker harness.

Each run takes two iterations (the second one's ratios differ from 1, so GSPO's per-sequence clip and CISPO's weight
truncation act: clip bounds of 3e-4 / 4e-4, GSPO's published ones, against an AdamW step of lr = 1e-4), with KL to the
reference policy, truncated importance sampling and an entropy bonus (the differentiable entropy of both backends'
heads). FSDP2 on one rank against Megatron at tp=1, tp=2 (vocabulary-parallel head and entropy) and pp=2 (the loss on
the last stage of megatron-core's 1F1B schedule): the step's metrics within 1e-5 relative, the clipped gradients the
optimizer sees and the parameters after the step as in test_megatron_step.py. Selectable with ``-k "gspo or cispo"``.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_megatron_step import ONE_RANK, TWO_RANKS, _models, _spawn

pytest.importorskip("megatron.core")

MODES = ("gspo", "gspo_token", "cispo")
METRICS = ("actor/loss", "actor/kl", "actor/entropy", "actor/clip_fraction", "actor/ratio_mean",
           "actor/tis_weight_mean", "rollout/logprob_diff", "actor/grad_norm")
LAYOUTS = ("megatron_tp1", "megatron_tp2", "megatron_pp2")
CASES = [(mode, layout) for mode in MODES for layout in LAYOUTS]


def algorithm(mode: str) -> dict:
    return {"policy_loss": mode, "num_iterations": 2, "clip_eps_low": 3e-4, "clip_eps_high": 4e-4,
            "entropy_coef": 0.01}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_losses")
    dirs = _models(root)
    one = [{"name": f"{backend}_{mode}", "backend": backend.split("_")[0], "microbatches": ONE_RANK,
            "algorithm": algorithm(mode)} for mode in MODES for backend in ("fsdp", "megatron_tp1")]
    out = _spawn(1, dirs, one, root)
    two = [{"name": f"megatron_{layout}_{mode}", "backend": "megatron", "microbatches": TWO_RANKS,
            "algorithm": algorithm(mode), layout[:2]: 2} for mode in MODES for layout in ("tp2", "pp2")]
    out.update(_spawn(2, dirs, two, root))
    diffs = {}
    for mode, layout in CASES:
        ref, got = out[f"fsdp_{mode}"]["result"]["metrics"], out[f"{layout}_{mode}"]["result"]["metrics"]
        diffs[f"{layout}_{mode}"] = {k: f"{abs(got[k] - ref[k]) / max(abs(ref[k]), 1e-12):.1e}" for k in METRICS}
    print(diffs)  # relative differences, shown by pytest -rA / -s
    return out


@pytest.mark.parametrize("mode, layout", CASES)
def test_megatron_step_matches_fsdp_for_each_policy_loss(steps, mode, layout):
    ref, got = steps[f"fsdp_{mode}"], steps[f"{layout}_{mode}"]
    r, m = ref["result"]["metrics"], got["result"]["metrics"]
    assert got["result"]["policy_version"] == ref["result"]["policy_version"] == 1 and not got["result"]["skipped"]
    assert r["actor/clip_fraction"] > 0.0 and r["actor/entropy"] > 1.0  # the clip acts at the second iteration
    for key in METRICS:
        assert abs(m[key] - r[key]) <= 1e-5 * max(1.0, abs(r[key])), (mode, layout, key, m[key], r[key])
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    for name in ref["params"]:
        torch.testing.assert_close(got["grads"][name], ref["grads"][name], rtol=1e-4, atol=1e-6 * scale,
                                   msg=lambda msg: f"{mode} {layout}: grad of {name}: {msg}")
        torch.testing.assert_close(got["params"][name], ref["params"][name], rtol=0, atol=1e-5,
                                   msg=lambda msg: f"{mode} {layout}: {name}: {msg}")


def test_the_policy_losses_give_different_steps(steps):
    """The parity above is of three different updates: each mode's gradients differ from the others'."""
    grads = {mode: torch.cat([g.flatten() for g in steps[f"fsdp_{mode}"]["grads"].values()]) for mode in MODES}
    assert float((grads["gspo"] - grads["cispo"]).abs().max()) > 1e-6
