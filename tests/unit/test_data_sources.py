"""Prompt sources beside jsonl (cluster/data/sources.py): local Hugging Face ``datasets`` files and reasoning-gym
tasks; their spec fields (refused before Ray starts, naming the field) and the ``reasoning_gym`` reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.data import DataError, Example
from cluster.data.sources import describe_source, load_examples, load_hf_examples, reasoning_gym_examples
from cluster.spec import SpecError, load_spec
from grpo.rewards import combine_rewards
from grpo.rewards.checks import row_checks
from grpo.rewards.reasoning_gym import extract_final_answer, generate_entries, score_completion

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("datasets")
pytest.importorskip("reasoning_gym")

ACCURACY = row_checks({"accuracy": "algorithm.rewards"})  # GSM8K's reward: the reference must be one number
ROWS = {"problem": ["What is 2+3?", "What is 10-4?", "Bad?"], "solution": ["2+3=5\n#### 5", "#### 6", "no marker"]}
EASY_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def _parquet(tmp_path: Path, rows=ROWS, name="train.parquet") -> Path:
    path = tmp_path / name
    pq.write_table(pa.table(rows), path)
    return path


def _spec(tmp_path: Path, data: str, rewards: str = "") -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: 2\ndata:\n{data}{rewards}")
    return path


# ---- Hugging Face datasets files ----------------------------------------------------------------------------------
def test_parquet_rows_load_like_jsonl_rows(tmp_path):
    path = _parquet(tmp_path)
    examples, skipped = load_hf_examples(str(path), question_field="problem", answer_field="solution",
                                         on_bad_row="skip", checks=ACCURACY)
    assert skipped == 1
    assert [(e.index, e.question, e.answer, e.reference) for e in examples] == [
        (0, "What is 2+3?", "2+3=5\n#### 5", "5"), (1, "What is 10-4?", "#### 6", "6")]
    assert examples[0].columns == {"solution": "2+3=5\n#### 5"}
    with pytest.raises(DataError, match=r"train.parquet:row 2: reward 'accuracy' \(algorithm.rewards\) cannot score "
                                        r"this row: .*got 'no marker'.*1 of 3 rows are refused; set "
                                        r"data.on_bad_row: skip"):
        load_hf_examples(str(path), question_field="problem", answer_field="solution", checks=ACCURACY)
    assert len(load_hf_examples(str(path), question_field="problem", answer_field="solution")[0]) == 3


def test_jsonl_and_glob_through_the_datasets_library(tmp_path):
    for part in range(2):
        rows = [{"question": f"Q{part}{i}?", "answer": f"#### {i}"} for i in range(3)]
        (tmp_path / f"part{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples, skipped = load_hf_examples(str(tmp_path / "part*.jsonl"), file_format="json")
    assert skipped == 0 and sorted(e.question for e in examples) == sorted(f"Q{p}{i}?" for p in range(2)
                                                                            for i in range(3))
    assert [e.index for e in examples] == list(range(6))


@pytest.mark.parametrize("make,kwargs,needle", [
    (lambda p: p / "missing.parquet", {}, "cannot load as 'parquet'"),
    (lambda p: (p / "junk.parquet").write_text("not parquet") and p / "junk.parquet", {}, "cannot load"),
    (_parquet, {"split": "test"}, "split 'test'"),
    (_parquet, {}, r"no column 'question' \(data.prompt_field \(unset, so data.question_field 'question'\)\); the "
                   r"data has columns \['problem', 'solution'\]: set data.prompt_field: problem"),
])
def test_hf_files_that_cannot_be_used_are_refused(tmp_path, make, kwargs, needle):
    with pytest.raises(DataError, match=needle):
        load_hf_examples(str(make(tmp_path)), **kwargs)


def test_spec_source_hf_datasets_reads_train_and_test_paths(tmp_path):
    train, test = _parquet(tmp_path), _parquet(tmp_path, {k: v[:1] for k, v in ROWS.items()}, "test.parquet")
    spec = load_spec(_spec(tmp_path, f"  source: hf_datasets\n  train_path: {train}\n  test_path: {test}\n"
                                     f"  question_field: problem\n  answer_field: solution\n  on_bad_row: skip\n"))
    assert [e.reference for e in load_examples(spec.data, "train", ACCURACY)[0]] == ["5", "6"]
    assert [e.reference for e in load_examples(spec.data, "held_out", ACCURACY)[0]] == ["5"]
    assert describe_source(spec.data) == f"{train} (parquet, split 'train')"
    broken = load_spec(_spec(tmp_path, f"  source: hf_datasets\n  train_path: {tmp_path / 'nope.parquet'}\n"))
    with pytest.raises(DataError, match=r"^data.train_path: .*nope.parquet"):
        load_examples(broken.data)
    with pytest.raises(DataError, match=r"^data.test_path: not set"):
        load_examples(broken.data, "held_out")


def test_default_source_is_jsonl_and_needs_train_path(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"question": "Q?", "answer": "#### 1"}) + "\n")
    spec = load_spec(_spec(tmp_path, f"  train_path: {tmp_path / 't.jsonl'}\n"))
    assert spec.data.source == "jsonl" and spec.data.reasoning_gym.task is None
    assert describe_source(spec.data) == str(tmp_path / "t.jsonl")
    assert load_examples(spec.data)[0] == [Example(0, "Q?", "#### 1", "1", "Q?", {"answer": "#### 1"})]
    with pytest.raises(SpecError, match=r"data.train_path: required key 'train_path' is missing"):
        load_spec(_spec(tmp_path, "  source: hf_datasets\n"))


# ---- reasoning-gym ------------------------------------------------------------------------------------------------
RG_DATA = (f"  source: reasoning_gym\n"
           f"  reasoning_gym: {{task: chain_sum, config: {json.dumps(EASY_SUMS)}, size: 40, seed: 7}}\n")
RG_REWARDS = "algorithm:\n  rewards: {reasoning_gym: 1.0, format: 0.1}\n"


def test_reasoning_gym_split_is_reproducible_by_seed_and_held_out_is_disjoint(tmp_path):
    spec = load_spec(_spec(tmp_path, RG_DATA, RG_REWARDS))
    rg = spec.data.reasoning_gym
    assert rg.eval_seed == 47  # seed + size: the first generator seed after the training range
    train, skipped = load_examples(spec.data, "train")
    again, _ = reasoning_gym_examples(rg, "train")
    assert skipped == 0 and len(train) == 40 and train == again
    assert [e.index for e in train] == list(range(40))
    other_seed = load_spec(_spec(tmp_path, RG_DATA.replace("seed: 7", "seed: 8"), RG_REWARDS))
    assert [e.question for e in reasoning_gym_examples(other_seed.data.reasoning_gym)[0]] != [e.question for e in train]
    held_out, dropped = load_examples(spec.data, "held_out")
    assert len(held_out) + dropped == rg.held_out_size == 200
    assert not {e.question for e in held_out} & {e.question for e in train}
    entries = generate_entries("chain_sum", EASY_SUMS, 7, 40)
    assert [e.question for e in train] == [e["question"] for e in entries]
    assert [e.answer for e in train] == [str(e["answer"]) for e in entries]
    assert describe_source(spec.data, "held_out") == "reasoning-gym chain_sum (seed 47, 200 problems)"


def test_reasoning_gym_reward_pays_the_right_answer_only(tmp_path):
    spec = load_spec(_spec(tmp_path, RG_DATA, RG_REWARDS))
    train, _ = load_examples(spec.data)
    ex = train[0]
    right = int(ex.answer)
    completions = [f"Adding step by step.\n#### {right}", f"#### {right + 1}", f"<answer>{right}</answer>",
                   f"The answer is {right}.", ""]
    refs = [ex.reference] * len(completions)
    assert [score_completion(c, r) for c, r in zip(completions, refs)] == [1.0, 0.0, 1.0, 0.0, 0.0]
    combined = combine_rewards(completions, refs, {"reasoning_gym": 1.0})
    assert combined.total.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="expected a reasoning-gym reference"):
        combine_rewards(["#### 5"], ["5"], {"reasoning_gym": 1.0})


def test_extract_final_answer():
    assert extract_final_answer("work\n#### 12\nextra") == "12"
    assert extract_final_answer("#### a\n#### b ") == "b"
    assert extract_final_answer("x <answer>1</answer> <answer> 2 </answer>") == "2"
    assert extract_final_answer("no answer line 5") is None and extract_final_answer("####   ") is None


def test_extract_final_answer_last_number_fallback():
    # the marker and the tag still win; only a completion with neither falls back to its last number
    assert extract_final_answer("3 + 4 = 7\n#### 8", "last_number") == "8"
    assert extract_final_answer("7 <answer>9</answer> 10", "last_number") == "9"
    assert extract_final_answer("12 - 19 = -7.", "last_number") == "-7"
    assert extract_final_answer("it is 1,234 or 5.50 apples", "last_number") == "5.50"
    assert extract_final_answer("total 1,234.", "last_number") == "1234"
    assert extract_final_answer("no digits here", "last_number") is None
    assert extract_final_answer("####   ", "last_number") is None  # an empty answer line is no answer


def test_last_number_extraction_rides_in_the_reference_and_pays_the_right_number_only(tmp_path):
    data = RG_DATA.replace("seed: 7}", "seed: 7, answer_extraction: last_number}")
    spec = load_spec(_spec(tmp_path, data, RG_REWARDS))
    assert spec.data.reasoning_gym.answer_extraction == "last_number"
    for split in ("train", "held_out"):
        ex = load_examples(spec.data, split)[0][0]
        assert json.loads(ex.reference)["answer_extraction"] == "last_number"
        right = int(ex.answer)
        assert score_completion(f"The sum is {right}.", ex.reference) == 1.0
        assert score_completion(f"The sum is {right + 1}.", ex.reference) == 0.0
        assert score_completion(f"{right}\n#### {right + 1}", ex.reference) == 0.0  # the marker wins
    strict = load_examples(load_spec(_spec(tmp_path, RG_DATA, RG_REWARDS)).data)[0][0]
    assert "answer_extraction" not in json.loads(strict.reference)  # default references are unchanged
    assert score_completion(f"The sum is {int(strict.answer)}.", strict.reference) == 0.0
    with pytest.raises(SpecError, match="data.reasoning_gym.answer_extraction"):
        load_spec(_spec(tmp_path, RG_DATA.replace("seed: 7}", "seed: 7, answer_extraction: first}"), RG_REWARDS))


@pytest.mark.parametrize("data,rewards,field,needle", [
    (RG_DATA.replace("chain_sum", "chain_sums"), RG_REWARDS, "data.reasoning_gym.task",
     "unknown reasoning-gym task 'chain_sums'; did you mean chain_sum"),
    ("  source: reasoning_gym\n", RG_REWARDS, "data.reasoning_gym.task", "required"),
    (RG_DATA.replace('"min_terms": 2', '"min_termz": 2'), RG_REWARDS, "data.reasoning_gym.config", "min_termz"),
    (RG_DATA.replace('"min_terms": 2', '"min_terms": 5'), RG_REWARDS, "data.reasoning_gym.config", "chain_sum"),
    (RG_DATA.replace("seed: 7}", "seed: 7, held_out_seed: 20}"), RG_REWARDS, "data.reasoning_gym.held_out_seed",
     "overlap"),
    (RG_DATA, "algorithm:\n  rewards: {format: 1.0}\n", "algorithm.rewards", "'reasoning_gym' weight"),
    (RG_DATA + "  test_path: test.jsonl\n", RG_REWARDS, "data.test_path", "not used with data.source 'reasoning_gym'"),
    (RG_DATA, "algorithm:\n  rewards: {reasoning_gym: 1.0, accuracy: 1.0}\n", "algorithm.rewards", "accuracy"),
])
def test_bad_reasoning_gym_specs_are_refused_naming_the_field(tmp_path, data, rewards, field, needle):
    with pytest.raises(SpecError) as info:
        load_spec(_spec(tmp_path, data, rewards))
    assert f"{field}: " in str(info.value) and needle in str(info.value), str(info.value)


def test_reasoning_gym_reward_needs_the_reasoning_gym_source(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"question": "Q?", "answer": "#### 1"}) + "\n")
    with pytest.raises(SpecError, match=r"algorithm.rewards: the 'reasoning_gym' reward scores problems from"):
        load_spec(_spec(tmp_path, f"  train_path: {tmp_path / 't.jsonl'}\n", RG_REWARDS))


def test_reasoning_gym_settings_on_another_source_are_refused_but_its_dumped_defaults_load(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"question": "Q?", "answer": "#### 1"}) + "\n")
    jsonl = f"  train_path: {tmp_path / 't.jsonl'}\n"
    with pytest.raises(SpecError, match=r"data.reasoning_gym.answer_extraction: used only with data.source "
                                        r"'reasoning_gym', got data.source 'jsonl'"):
        load_spec(_spec(tmp_path, jsonl + "  reasoning_gym: {answer_extraction: last_number}\n"))
    dumped = load_spec(_spec(tmp_path, jsonl + "  reasoning_gym: {task: null, size: 2000, partial_credit: false}\n"))
    assert dumped.data.source == "jsonl"


def test_cli_validate_refuses_an_unknown_task_with_exit_2(tmp_path, capsys):
    from cluster.cli import main

    spec = _spec(tmp_path, RG_DATA.replace("chain_sum", "no_such_task"), RG_REWARDS)
    assert main(["validate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "data.reasoning_gym.task: unknown reasoning-gym task 'no_such_task'" in err


def test_the_reasoning_gym_example_spec_is_valid():
    spec = load_spec(Path(__file__).resolve().parents[2] / "examples" / "chain_sum_smollm2_cpu.yaml")
    assert spec.data.source == "reasoning_gym" and spec.data.reasoning_gym.task == "chain_sum"
    assert spec.algorithm.rewards == {"reasoning_gym": 1.0, "format": 0.1}


def test_partial_credit_is_off_by_default_and_rides_in_the_reference(tmp_path):
    data = RG_DATA.replace("seed: 7}", "seed: 7, answer_extraction: last_number}")
    ex = load_examples(load_spec(_spec(tmp_path, data, RG_REWARDS)).data)[0][0]
    right = int(ex.answer)
    wrong_but_containing = [f"{right}1", f"{right}.5", f"-{right}" if right > 0 else f"{right}1"]
    # chain_sum's scorer pays len(oracle)/len(answer) for an answer containing the oracle: a wrong answer, 0.0 here
    assert [score_completion(c, ex.reference) for c in wrong_but_containing] == [0.0, 0.0, 0.0]
    assert score_completion(str(right), ex.reference) == 1.0 and "partial_credit" not in json.loads(ex.reference)
    with_partial = data.replace("last_number}", "last_number, partial_credit: true}")
    partial = load_examples(load_spec(_spec(tmp_path, with_partial, RG_REWARDS)).data)[0][0]
    assert json.loads(partial.reference)["partial_credit"] is True
    scores = [score_completion(c, partial.reference) for c in wrong_but_containing]
    assert all(0.0 < s < 1.0 for s in scores), scores


def test_the_learning_example_spec_evaluates_and_guards_the_task_it_trains():
    """examples/learn_cpu.yaml, the measured run (results.md): eval at step 0, every 10 steps and at the end on the
    held-out split, scored like training (last-number fallback); the guard's verifiable reward is the task scorer."""
    spec = load_spec(Path(__file__).resolve().parents[2] / "examples" / "learn_cpu.yaml")
    rg = spec.data.reasoning_gym
    assert (rg.task, rg.answer_extraction, spec.total_steps) == ("chain_sum", "last_number", 40)
    assert spec.eval.at_start and spec.eval.at_end and spec.eval.every_steps == 10
    assert spec.eval.accuracy_reward == spec.monitor.verifiable_reward == "reasoning_gym"
    assert spec.monitor.enabled and spec.checkpoint.keep_best


def test_reasoning_gym_fields_take_set_overrides_and_survive_the_yaml_round_trip(tmp_path):
    from cluster.spec import load_spec_text, spec_to_yaml

    (tmp_path / "t.jsonl").write_text(json.dumps({"question": "Q?", "answer": "#### 1"}) + "\n")
    spec = load_spec(_spec(tmp_path, f"  train_path: {tmp_path / 't.jsonl'}\n"), [
        "data.source=reasoning_gym", "data.train_path=null", "data.reasoning_gym.task=basic_arithmetic",
        "data.reasoning_gym.config.min_terms=2", "data.reasoning_gym.config.max_terms=2",
        "algorithm.rewards={reasoning_gym: 1.0}"])
    assert spec.data.reasoning_gym.config == {"min_terms": 2, "max_terms": 2}
    assert load_spec_text(spec_to_yaml(spec), source="again.yaml") == spec


def test_validate_summarises_the_held_out_split_and_a_task_space_too_small_for_one(tmp_path):
    from cluster.ops.cli_validate import held_out_summary

    spec = load_spec(_spec(tmp_path, RG_DATA, RG_REWARDS))
    held_out, dropped = load_examples(spec.data, "held_out")
    assert held_out_summary(spec.data) == (f"{len(held_out)} problems from reasoning-gym chain_sum (seed 47, 200 "
                                           f"problems) ({dropped} dropped: also training problems)")
    one_digit = RG_DATA.replace('"max_digits": 2', '"max_digits": 1').replace("size: 40", "size: 3000")
    tiny = load_spec(_spec(tmp_path, one_digit, RG_REWARDS))
    assert held_out_summary(tiny.data).startswith("none: data.reasoning_gym: all 200 held-out problems")


# ---- held-out evaluation on the source's own split ------------------------------------------------------------------
@pytest.fixture
def char_prompts(monkeypatch):
    """Prompt ids of one token per question character (enough for the prompt-length filter), no tokenizer."""
    import cluster.loop.evaluation as evaluation

    monkeypatch.setattr(evaluation, "prompt_ids",
                        lambda data, tok, examples, what: [[0] * len(e.question) for e in examples])


def test_eval_reads_the_reasoning_gym_held_out_split_and_scores_it_with_the_task(tmp_path, char_prompts):
    from cluster.loop.evaluation import load_eval_set

    spec = load_spec(_spec(tmp_path, RG_DATA, RG_REWARDS + "eval: {accuracy_reward: reasoning_gym, limit: 5}\n"))
    evalset = load_eval_set(spec.eval, spec.data, None)
    held_out, _ = load_examples(spec.data, "held_out")
    assert evalset.examples == held_out[:5] and evalset.field == "data.reasoning_gym"
    with pytest.raises(SpecError, match=r"eval\.accuracy_reward: .*expected 'reasoning_gym', got 'accuracy'"):
        load_spec(_spec(tmp_path, RG_DATA, RG_REWARDS + "eval: {accuracy_reward: accuracy}\n"))


def test_a_generated_task_implies_its_own_reward_where_the_spec_leaves_it_out(tmp_path):
    """``data: {reasoning_gym: {task: chain_sum}}`` with no source, no rewards, ``eval: {}`` and ``monitor: {}``: the
    task implies data.source, algorithm.rewards, eval.accuracy_reward and monitor.verifiable_reward."""
    implied = RG_DATA.replace("  source: reasoning_gym\n", "")
    assert implied != RG_DATA
    spec = load_spec(_spec(tmp_path, implied, "eval: {limit: 5}\nmonitor: {action: warn}\n"))
    assert spec.data.source == "reasoning_gym" and dict(spec.algorithm.rewards) == {"reasoning_gym": 1.0}
    assert spec.eval.accuracy_reward == "reasoning_gym" and spec.monitor.verifiable_reward == "reasoning_gym"


def test_the_reasoning_gym_reward_in_eval_needs_the_reasoning_gym_split(tmp_path):
    jsonl = f"  train_path: {tmp_path / 't.jsonl'}\n  test_path: {tmp_path / 't.jsonl'}\n"
    with pytest.raises(SpecError, match=r"eval\.accuracy_reward: 'reasoning_gym' scores problems of the reasoning-gym"):
        load_spec(_spec(tmp_path, jsonl, "eval: {accuracy_reward: reasoning_gym}\n"))
    with pytest.raises(SpecError, match=r"eval\.format_reward: 'reasoning_gym' scores"):
        load_spec(_spec(tmp_path, jsonl, "eval: {format_reward: reasoning_gym}\n"))


def test_eval_data_path_of_an_hf_datasets_source_is_read_in_its_format(tmp_path, char_prompts):
    from cluster.loop.evaluation import load_eval_set

    train = _parquet(tmp_path)
    held = _parquet(tmp_path, {"problem": ["What is 1+1?"], "solution": ["1+1=2\n#### 2"]}, name="held.parquet")
    data = (f"  source: hf_datasets\n  train_path: {train}\n  question_field: problem\n  answer_field: solution\n"
            f"  on_bad_row: skip\n")
    spec = load_spec(_spec(tmp_path, data, f"eval: {{data_path: {held}}}\n"))
    evalset = load_eval_set(spec.eval, spec.data, None)
    assert [e.reference for e in evalset.examples] == ["2"] and evalset.field == "eval.data_path"
