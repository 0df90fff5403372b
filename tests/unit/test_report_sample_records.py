"""The step's samples (``cluster.loop.samples``, ``cluster.sinks.samples``): which groups a step shows, each token's
text, the caps that bound ``samples.jsonl``, why a completion adds no gradient, a multi-turn completion's turns and
tool calls; and the file cut back with ``metrics.jsonl`` on a resume and followed after a rollback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cluster.driver import GRPOJob
from cluster.loop.checkpoints import truncate_jsonl
from cluster.loop.samples import SampleRecorder, TokenTexts, _turns, chosen_groups, sample_rows
from cluster.sinks.samples import SampleLog, read_samples
from cluster.spec import load_spec_text
from contract.batches import RolloutBatch
from contract.messages import EpisodeSummary, TrainResult
from tests.job_runs import run_to_end
from tests.stand_ins import StandInFleet, StandInTrainer


def _batch(rewards: list[list[float]], lengths: int = 3, valid: list[int] | None = None) -> RolloutBatch:
    """Groups of the given rewards (a group per inner list, its group id 10 + its index), responses of ``lengths``
    tokens, advantages = reward − the group's mean."""
    flat = [r for group in rewards for r in group]
    gids = [10 + g for g, group in enumerate(rewards) for _ in group]
    adv = [r - sum(group) / len(group) for group in rewards for r in group]
    n = len(flat)
    return RolloutBatch(
        prompt_ids=[[1, 2, 3]] * n, response_ids=[[5 + i % 3] * lengths for i in range(n)],
        behaviour_logprobs=[torch.full((lengths,), -1.0) for _ in range(n)], finish_reasons=["stop"] * n,
        texts=["x" * lengths] * n, references=["7"] * n, versions=[3] * n,
        group_ids=torch.tensor(gids), valid_lengths=valid if valid is not None else [lengths] * n,
        terminated=[True] * n, rewards=torch.tensor(flat, dtype=torch.float32),
        per_function={"accuracy": torch.tensor(flat, dtype=torch.float32)},
        advantages=torch.tensor(adv, dtype=torch.float32))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_samples_are_the_first_groups_with_the_first_mixed_one_among_them():
    batch = _batch([[0, 0], [1, 1], [0, 1], [1, 0], [0, 0]])
    assert chosen_groups(batch, 2) == [10, 12]  # group 12 is the first whose rewards differ
    assert chosen_groups(batch, 1) == [12]
    assert chosen_groups(batch, 3) == [10, 11, 12]
    assert chosen_groups(batch, 9) == [10, 11, 12, 13, 14] and chosen_groups(batch, 0) == []
    assert chosen_groups(_batch([[0, 0], [1, 1], [0, 0]]), 2) == [10, 11]  # none mixed: the first ones
    assert chosen_groups(_batch([[0, 0], [float("nan"), 1], [1, 0]]), 1) == [12]  # a missing reward is no signal
    assert sample_rows(batch, 2) == [0, 1, 4, 5]


@pytest.mark.parametrize("text", ["Hello world, 12 + 30 = 42.\n#### 42", "naïve café — 漢字 🙂🙂 end",
                                  "<|im_start|>assistant\n  spaced   out<|im_end|>"])
def test_samples_token_texts_join_to_the_decoded_completion(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = TokenTexts(tokenizer)(ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert "\ufffd" not in "".join(pieces)


def test_samples_are_cut_to_sample_max_tokens(tokenizer):
    batch = _batch([[0, 1]], lengths=12)
    batch.prompt_ids = [list(range(100, 120))] * 2
    recorder = SampleRecorder(tokenizer, samples_per_step=1, max_tokens=5)
    recorder.train_records(4, batch, TrainResult(5, False, "", {}, token_logprobs={0: [-0.5] * 12}), 4, 5)
    (record,) = recorder.take()
    assert record["prompt_tokens"] == 20 and record["prompt_cut"]
    assert record["prompt"] == tokenizer.decode(list(range(115, 120)), skip_special_tokens=False)
    first, second = record["completions"]
    assert first["cut"] and first["length"] == 12 and first["loss_tokens"] == 12
    assert len(first["tokens"]) == len(first["trained"]) == len(first["gap"]) == 5
    assert first["gap"] == [0.5] * 5 and second["gap"] == [None] * 5  # row 1 was not traced
    assert first["text"] == tokenizer.decode([5] * 5, skip_special_tokens=False)
    assert recorder.take() == []


def test_samples_say_why_a_completion_adds_no_gradient(tokenizer):
    batch = _batch([[0, 1, 1], [1, 1, 1]], valid=[3, 0, 3, 3, 3, 3])
    batch.rewards[2] = float("nan")
    recorder = SampleRecorder(tokenizer, samples_per_step=2, max_tokens=8)
    recorder.train_records(1, batch, TrainResult(1, False, "", {}), 0, 1)
    mixed, flat = recorder.take()
    assert [c["excluded"] is None for c in mixed["completions"]] == [True, False, False]
    assert "no token in the loss" in mixed["completions"][1]["excluded"]
    assert mixed["completions"][1]["trained"] == "000"
    assert "no reward" in mixed["completions"][2]["excluded"] and mixed["completions"][2]["reward"] is None
    assert all("advantage 0" in c["excluded"] for c in flat["completions"]) and not flat["mixed"]
    assert json.loads(json.dumps(mixed, allow_nan=False)) == mixed  # plain JSON, no NaN


def test_samples_of_an_episode_split_into_turns_with_their_tool_calls(tokenizer):
    texts = ["I'll ", "use it ", '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>',
             "\ncalculator: 6\n", "#### 6", "<tool_call>{oops</tool_call>"]
    turns = _turns(texts, [True, True, True, False, True, True])
    assert [(t["role"], t["start"], t["end"]) for t in turns] == [("assistant", 0, 3), ("observation", 3, 4),
                                                                    ("assistant", 4, 6)]
    assert turns[0]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "2*3"}}]
    assert "tool_calls" not in turns[1] and turns[1]["text"] == "\ncalculator: 6\n"
    assert "not valid JSON" in turns[2]["tool_calls"][0]["error"]
    batch = _batch([[0, 1]], lengths=4)
    batch.loss_masks = [[True, False, False, True], [True, True, True, True]]
    batch.episodes = [EpisodeSummary(turns=2, tool_calls=1, observation_tokens=2, ended="done")] * 2
    recorder = SampleRecorder(tokenizer, samples_per_step=1, max_tokens=8)
    recorder.train_records(1, batch, TrainResult(1, False, "", {}), 0, 1)
    first = recorder.take()[0]["completions"][0]
    assert [t["role"] for t in first["turns"]] == ["assistant", "observation", "assistant"]
    assert first["trained"] == "1001" and first["sampled_tokens"] == 2
    assert first["episode"]["tool_calls"] == 1 and first["episode"]["ended"] == "done"


def test_samples_jsonl_follows_a_file_cut_back_by_a_rollback(tmp_path):
    log = SampleLog(tmp_path)
    log.log_samples(1, [{"step": 1, "kind": "train", "completions": []}])
    log.log_samples(2, [{"step": 2, "kind": "train", "completions": []}])
    truncate_jsonl(log.path, 1)  # what a rollback to step 1's checkpoint does (an atomic rename)
    log.reopen()
    log.log_samples(2, [{"step": 2, "kind": "train", "completions": [], "again": True}])
    log.close()
    assert [(r["step"], r.get("again")) for r in read_samples(log.path)] == [(1, None), (2, True)]
    with pytest.raises(ValueError, match="must carry 'step': 3"):
        log.log_samples(3, [{"step": 2}])


def _spec(tmp_path: Path, model: str, total_steps: int):
    rows = "".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                   for i in range(8))
    (tmp_path / "train.jsonl").write_text(rows)
    return load_spec_text(
        f"name: resumed\noutput_dir: {tmp_path / 'out'}\ntotal_steps: {total_steps}\nmodel: {{path: {model}}}\n"
        f"data: {{train_path: {tmp_path / 'train.jsonl'}}}\nrollout: {{prompts_per_step: 2, group_size: 2}}\n"
        f"metrics: {{port: null, samples_per_step: 1}}\ncheckpoint: {{every_steps: 2, save_final: false}}\n")


def test_samples_jsonl_is_cut_back_with_metrics_jsonl_on_resume(tmp_path, tiny_model_dir):
    spec = _spec(tmp_path, tiny_model_dir, total_steps=3)
    run_to_end(GRPOJob(spec, fleet=StandInFleet(), trainer=StandInTrainer(), progress=False))
    path = Path(spec.output_dir) / "samples.jsonl"
    assert [r["step"] for r in read_samples(path)] == [1, 2, 3]
    with path.open("a") as f:
        f.write('{"step": 3, "kind": "tra')  # a crash mid-write
    run_to_end(GRPOJob(spec, fleet=StandInFleet(), trainer=StandInTrainer(), progress=False, resume=True))
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # step 3 once, redone; the torn line gone
    metrics = [json.loads(line)["step"] for line in (Path(spec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [1, 2, 3]
