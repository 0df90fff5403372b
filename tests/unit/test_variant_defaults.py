"""Issue 35 item 4, defaults that fit the choice: a chosen variant whose companion settings' plain defaults belong to
another choice implies its own source's values unless the spec sets them (``cluster.spec.implied``): a sequence-level
policy loss its paper's clip range, Dr. GRPO its loss aggregation, LoRA its learning rate; ``grpo-cluster validate``
prints the values in force and which a choice implied."""

from __future__ import annotations

import json

import pytest

from cluster.cli import main
from cluster.spec import SpecError, load_spec_text, spec_to_yaml

MINIMAL = "output_dir: out\ntotal_steps: 3\ndata: {train_path: t.jsonl}\n"


def load(*overrides: str):
    return load_spec_text(MINIMAL, overrides=overrides)


def test_variant_defaults_a_policy_loss_brings_its_papers_clip_range():
    """GSPO clips a sequence's geometric-mean ratio in [1 - 3e-4, 1 + 4e-4] (Zheng et al. 2025, sec. 5.1), not PPO's
    token-level 0.2 (about 500x wider); CISPO puts no lower bound on its weight (MiniMax-M1)."""
    for loss, clip in {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "cispo": (0.999, 0.2),
                       "ppo": (0.2, 0.2)}.items():
        alg = load(f"algorithm.policy_loss={loss}").algorithm
        assert (alg.clip_eps_low, alg.clip_eps_high) == clip, loss


def test_variant_defaults_a_clip_the_spec_gives_is_kept():
    alg = load("algorithm.policy_loss=gspo", "algorithm.clip_eps_high=0.01").algorithm
    assert (alg.clip_eps_low, alg.clip_eps_high) == (3e-4, 0.01)
    alg = load("algorithm.policy_loss=gspo", "algorithm.clip_eps_low=0.2", "algorithm.clip_eps_high=0.2").algorithm
    assert (alg.clip_eps_low, alg.clip_eps_high) == (0.2, 0.2)


def test_variant_defaults_dr_grpo_brings_its_loss_aggregation():
    """Dr. GRPO removes the length normalisation along with the std's (Liu et al. 2025, sec. 3.2): the token losses
    are summed over a constant, which is ``seq-mean-token-sum-norm``."""
    assert load("algorithm.advantage_estimator=dr_grpo").algorithm.loss_agg == "seq-mean-token-sum-norm"
    assert load("algorithm.advantage_estimator=dr_grpo", "algorithm.loss_agg=token-mean").algorithm.loss_agg == \
        "token-mean"
    assert load().algorithm.loss_agg == "seq-mean-token-mean"


def test_variant_defaults_lora_brings_its_learning_rate():
    """LoRA's optimal learning rate is about 10x full fine-tuning's (Schulman et al. 2025, "LoRA Without Regret")."""
    assert load("train.lora={rank: 8}").train.lr == 1e-5
    assert load("train.lora={rank: 8}", "train.lr=3e-6").train.lr == 3e-6
    assert load().train.lr == 1e-6


def test_variant_defaults_implied_values_are_told_from_given_ones_and_survive_a_round_trip():
    from cluster.spec.implied import implied_settings

    spec = load("algorithm.policy_loss=gspo", "algorithm.clip_eps_high=0.01", "algorithm.advantage_estimator=dr_grpo",
                "rollout.mode=async", "train.lora={rank: 8}")
    implied = {i.field: i.value for i in implied_settings(spec)}
    assert implied == {"algorithm.loss_agg": "seq-mean-token-sum-norm", "algorithm.clip_eps_low": 3e-4,
                       "rollout.max_staleness": 1, "train.lr": 1e-5}
    why = {i.field: i.why for i in implied_settings(spec)}
    assert why["algorithm.clip_eps_low"].startswith("algorithm.policy_loss gspo: GSPO's clip range")
    again = load_spec_text(spec_to_yaml(spec))
    assert again == spec and implied_settings(again) == []  # written back, every value is given


def test_variant_defaults_a_registered_variant_brings_its_own_and_conflicts_are_refused():
    from grpo.advantages import ADVANTAGE_ESTIMATORS, register_advantage_estimator
    from grpo.policy_losses import POLICY_LOSSES, register_policy_loss
    from tests.registered import variant_registered

    def term(logprobs, old_logprobs, advantages, mask, *, clip_eps_low, clip_eps_high, dual_clip_c):
        raise AssertionError("not called")

    def estimator(rewards, stats, *, eps, std):
        raise AssertionError("not called")

    def register_loss():
        register_policy_loss("test_seq_loss", implies={"clip_eps_low": 1e-3, "loss_agg": "token-mean"},
                             why="a test's source")(term)

    with variant_registered(POLICY_LOSSES, "test_seq_loss", register_loss):
        alg = load("algorithm.policy_loss=test_seq_loss").algorithm
        assert (alg.clip_eps_low, alg.clip_eps_high, alg.loss_agg) == (1e-3, 0.2, "token-mean")
        with pytest.raises(SpecError, match=r"algorithm.policy_loss='test_seq_loss' implies loss_agg 'token-mean', "
                                            r"another choice 'seq-mean-token-sum-norm' .*set loss_agg in the spec"):
            load("algorithm.policy_loss=test_seq_loss", "algorithm.advantage_estimator=dr_grpo")
        assert load("algorithm.policy_loss=test_seq_loss", "algorithm.advantage_estimator=dr_grpo",
                    "algorithm.loss_agg=token-mean").algorithm.loss_agg == "token-mean"
    with pytest.raises(ValueError, match="need their source"):
        register_advantage_estimator("test_no_source", implies={"loss_agg": "token-mean"})(estimator)
    assert "test_no_source" not in ADVANTAGE_ESTIMATORS


def _spec_file(tmp_path, model: str, extra: str = "") -> str:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(4)))
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: check\noutput_dir: {tmp_path / 'out'}\ntotal_steps: 3\nmodel: {{path: {model}}}\n"
                    f"data: {{train_path: {data}}}\nmetrics: {{port: 0}}\n{extra}")
    return str(spec)


def test_variant_defaults_validate_prints_the_values_in_force_and_what_was_implied(tmp_path, tiny_model_dir, capsys,
                                                                                    monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = _spec_file(tmp_path, tiny_model_dir, "algorithm: {policy_loss: gspo, clip_eps_high: 0.001}\n")
    assert main(["validate", spec]) == 0
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in capsys.readouterr().out.splitlines()
             if ":" in line}
    assert ("policy_loss gspo (clip_eps_low 0.0003 (implied), clip_eps_high 0.001, dual_clip_c null)"
            in lines["variants"]), lines["variants"]
    assert "advantage_estimator grpo (adv_eps 1e-06, adv_std unbiased, loss_agg seq-mean-token-mean)" in \
        lines["variants"]
    assert "train.strategy fsdp (tensor_parallel_size 1, pipeline_parallel_size 1, sequence_parallel false)" in \
        lines["variants"]
    assert lines["implied"] == ("algorithm.clip_eps_low 0.0003 (algorithm.policy_loss gspo: GSPO's clip range of its "
                                "sequence-level ratio (Zheng et al. 2025, sec. 5.1))")
    assert "ratio clipped to [0.9997, 1.001] (policy loss gspo)" in lines["algorithm"]
    assert main(["validate", _spec_file(tmp_path, tiny_model_dir)]) == 0
    assert "implied:    none: every setting in force is given by the spec or is its field's default" in \
        capsys.readouterr().out
