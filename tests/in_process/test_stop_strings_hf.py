"""Stop strings (``rollout.stop``) on the ``hf`` engine, and ``rollout.engine: hf`` running a spec in process (issue 36,
items 1 and 6), on the tiny random Llama:

- a stop string that ends inside a token: the completion ends with that token, kept whole (its ids exactly as
  sampled), finish reason ``"stop"``, the text cut at the stop string's end; the tokens before are those the same seed
  samples without the stop string; one begun before a partial rollout's interruption ends the continued completion;
- multi-turn episodes: every turn that ends before its cap ends with the token that completes a stop string;
- a whole job with ``rollout.engine: hf`` and stop strings: the trainer trains exactly the sampled tokens (its
  logprobs equal the engine's), and completions ended by a stop string count as terminated.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cluster.data import Example
from cluster.in_process import local_job
from cluster.loop.environment_host import LocalEnvironments
from cluster.loop.episodes import EpisodeRunner
from cluster.spec import RolloutSpec
from contract.messages import INTERRUPTED, GroupRequest, GroupResult, SamplingOverride
from rollout_workers.hf.engine import HFEngine
from tests.job_runs import stopped_after
from tests.local_runtime import PROMPTS, local_spec, requests_for, running
from tests.registered import parity_reward, temporarily_registered

STOPS = ["e", "a"]  # frequent in the random model's text: most turns end at one


def _mid_token_stop(tok, ids: list[int]) -> tuple[int, str]:
    """(k, stop): the first token k >= 1 whose text adds >= 2 characters, and a stop string ending after its first
    character (the last 3 characters before it + that one)."""
    texts = [tok.decode(ids[:i + 1], skip_special_tokens=True) for i in range(len(ids))]
    for k in range(1, len(ids)):
        new = texts[k][len(texts[k - 1]):]
        if len(new) >= 2 and texts[k].startswith(texts[k - 1]) and texts[k - 1]:
            return k, texts[k - 1][-3:] + new[0]
    raise AssertionError(f"no token adds two characters in {texts[-1]!r}")


def test_stop_strings_hf_engine_keeps_the_token_a_stop_string_ends_in(tiny_model_dir):
    rollout = RolloutSpec(max_response_tokens=24, group_size=2)
    engine = HFEngine(tiny_model_dir, rollout, "float32", 0, 512)
    tok = engine.tokenizer
    request = GroupRequest(0, tok(PROMPTS[0])["input_ids"], seed=7)
    free = engine.generate([request], 2)[0][0]
    ids = free.response_ids[0]
    k, stop = _mid_token_stop(tok, ids)
    engine.rollout = rollout.model_copy(update={"stop": [stop]})
    stopped = engine.generate([request], 2)[0][0]
    assert stopped.response_ids[0] == ids[:k + 1]  # through the token the stop string ends in, all of it
    assert stopped.finish_reasons[0] == "stop"
    text = stopped.texts[0]
    assert text.endswith(stop) and tok.decode(ids[:k + 1], skip_special_tokens=True).startswith(text)
    assert len(text) < len(tok.decode(ids[:k + 1], skip_special_tokens=True))  # cut inside the last token
    assert stopped.behaviour_logprobs[0].tolist() == free.behaviour_logprobs[0][:k + 1].tolist()


def test_stop_strings_straddling_an_interruption_end_the_continued_completion(tiny_model_dir):
    """A completion interrupted after k sampled tokens is continued greedily (deterministic); a stop string made of
    the last characters before the interruption and the first one the continuation writes ends it at that token."""
    rollout = RolloutSpec(max_response_tokens=24)
    engine = HFEngine(tiny_model_dir, rollout, "float32", 0, 512)
    tok = engine.tokenizer
    request = GroupRequest(0, tok(PROMPTS[0])["input_ids"], group_size=1, seed=7)
    sampled = engine.generate([request], 1)[0][0]
    k = 6
    prior = GroupResult(0, request.prompt_ids, [sampled.response_ids[0][:k]], [sampled.behaviour_logprobs[0][:k]],
                        [INTERRUPTED], [""], 0, [[0] * k])
    resume = replace(request, sampling=SamplingOverride(0.0, 24), resume_from=prior)
    free = engine.generate([resume], 1)[0][0].response_ids[0]
    before, after = tok.decode(free[:k]), tok.decode(free[:k + 1])
    assert after.startswith(before) and len(after) > len(before)
    stop = before[-2:] + after[len(before)]  # begins before the interruption, ends in the first continued token
    engine.rollout = rollout.model_copy(update={"stop": [stop]})
    resumed = engine.generate([resume], 1)[0][0]
    assert resumed.response_ids[0] == free[:k + 1] and resumed.finish_reasons[0] == "stop"


def test_stop_strings_end_the_turns_of_multi_turn_episodes(tiny_model_dir, tmp_path):
    cap = 12
    section = {"environment": "scripted", "options": {"observations": ["ok"], "done_after": 3}, "max_turns": 3,
               "max_episode_tokens": 200}
    spec = local_spec(tiny_model_dir, str(tmp_path), rollout={"max_response_tokens": cap, "multi_turn": section,
                                                              "stop": STOPS})
    rows = [Example(0, PROMPTS[0], "5", "5"), Example(1, PROMPTS[1], "red", "red")]
    with running(spec, tiny_model_dir) as (_, fleet, _):
        tok = fleet.tokenizer
        mt = spec.rollout.multi_turn
        runner = EpisodeRunner(spec, tok, LocalEnvironments(mt.environment, mt.options, 2, mt.step_timeout_s))
        groups = runner.run(fleet, requests_for(tok, PROMPTS[:2]), rows)
    early = 0
    for group in groups:
        for ids, mask in zip(group.response_ids, group.loss_masks):
            turns, start = [], None
            for i, sampled in enumerate(mask + [False]):
                if sampled and start is None:
                    start = i
                elif not sampled and start is not None:
                    turns.append(ids[start:i])
                    start = None
            assert len(turns) == 3
            for turn in turns:
                text = tok.decode(turn, skip_special_tokens=True)
                before = tok.decode(turn[:-1], skip_special_tokens=True)
                if len(turn) < cap:  # ended by a stop string (the random model samples no EOS)
                    early += 1
                    assert any(s in text for s in STOPS) and not any(s in before for s in STOPS), (text, before)
                else:
                    assert not any(s in before for s in STOPS), text
    assert early >= 6, early


@pytest.fixture(scope="module")
def parity():
    yield from temporarily_registered("parity", parity_reward)


def test_rollout_engine_hf_runs_a_spec_in_process_and_trains_the_sampled_tokens(tiny_model_dir, parity,
                                                                                tmp_path):
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": f"#### {2 * i + 1}"} for i in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec = local_spec(tiny_model_dir, str(tmp_path / "out"), total_steps=1,
                      rollout={"engine": "hf", "stop": STOPS, "max_response_tokens": 12},
                      data={"train_path": str(tmp_path / "train.jsonl"), "max_prompt_tokens": 256},
                      algorithm={"kl_coef": 0.04, "rewards": {"parity": 1.0, "accuracy": 0.0, "format": 0.0},
                                 "mask_truncated": True},
                      metrics={"port": None}, checkpoint={"every_steps": 0, "save_final": False})
    with stopped_after(local_job(spec, progress=False)) as job:
        history = job.run()
    step = history[0]
    assert step["policy_version"] == 1 and step["sync/verified"] is True
    assert step["response_length/mean"] < 12  # stop strings ended completions early
    assert step["response_length/clip_ratio"] < 1.0  # ... and they count as terminated (mask_truncated keeps them)
    assert step["rollout/logprob_diff"] < 2e-5  # the trainer scored exactly the sampled tokens
