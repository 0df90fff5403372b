"""GSM8K jsonl loading (bad rows reported as file:line; the accuracy reward's row check), the resumable prompt sampler,
chat prompts."""

import json
import re
from pathlib import Path

import pytest

from cluster.data import (DataError, Example, PromptSampler, build_chat_prompt, extract_reference,
                          load_jsonl_examples)
from grpo.rewards.checks import row_checks
from tests.shared_data import BESIDE, SHARED_DATA

ACCURACY = row_checks({"accuracy": "algorithm.rewards"})  # GSM8K's reward: the reference must be one number

GSM8K_TRAIN = SHARED_DATA / "gsm8k" / "train.jsonl"


def row(question="What is 2+3?", answer="2+3 = 5\n#### 5", **extra):
    return json.dumps({"question": question, "answer": answer, **extra})


def write_lines(tmp_path: Path, lines, name="data.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines))
    return path


def test_loads_rows_and_reference(tmp_path):
    path = write_lines(tmp_path, [row(), "", row("Q2?", "x\n#### 1,234 "), "   "])
    examples, skipped = load_jsonl_examples(path, checks=ACCURACY)
    assert skipped == 0
    assert [(e.index, e.question, e.answer, e.reference) for e in examples] == [
        (0, "What is 2+3?", "2+3 = 5\n#### 5", "5"), (1, "Q2?", "x\n#### 1,234 ", "1,234")]
    assert examples[0].prompt == "What is 2+3?" and examples[0].columns == {"answer": "2+3 = 5\n#### 5"}


def test_custom_fields(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"problem": "P?", "solution": "s #### 7"})])
    examples, _ = load_jsonl_examples(path, question_field="problem", answer_field="solution")
    assert examples[0].reference == "7"


# refused whatever the rewards
BAD_ROWS = [
    ("{not json", "invalid JSON"),
    (b"\xff\xfe{}", "invalid UTF-8"),
    ("[1, 2]", "expected a JSON object with a prompt column 'question' (data.prompt_field (unset, so "
               "data.question_field 'question')), got list"),
    (json.dumps({"question": 3, "answer": "#### 3"}), "field 'question': expected a string or a list of"),
    (row(question="  "), "field 'question' is empty"),
]
# refused by the accuracy reward's row check only
BAD_FOR_ACCURACY = [
    (json.dumps({"question": "Q?"}), "reward 'accuracy' (algorithm.rewards) cannot score this row: it reads the "
                                     "answer column (data.answer_field) as its reference, which the row lacks; "
                                     "data.answer_field is 'answer' and the row has keys ['question']"),
    (row(answer="the answer is 5"), "expected a number after the last '####' of the answer (or an answer that is "
                                    "one number: the accuracy reward compares numbers), got 'the answer is 5'"),
    (row(answer="5 ####  "), "the reference is empty (nothing after the answer's last '####')"),
    (row(answer="so #### five"), "got 'five'; data.answer_field 'answer' = 'so #### five'"),
    (row(answer="#### 1e400"), "expected a number after the last '####'"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_ROWS + BAD_FOR_ACCURACY)
def test_bad_row_is_reported_with_file_and_line(tmp_path, bad, reason):
    path = write_lines(tmp_path, [row(), "", bad, row()])
    with pytest.raises(DataError) as info:
        load_jsonl_examples(path, checks=ACCURACY)
    assert str(info.value).startswith(f"{path}:3: ")
    assert reason in str(info.value)
    assert "(1 of 3 rows are refused; set data.on_bad_row: skip to drop them, or fix them)" in str(info.value)


@pytest.mark.parametrize(("bad", "reason"), BAD_FOR_ACCURACY)
def test_a_reference_format_is_checked_only_for_a_reward_that_reads_it(tmp_path, bad, reason):
    """Issue #27: rows were refused for lacking '#### <number>' whatever reward the job used."""
    path = write_lines(tmp_path, [row(), bad])
    examples, skipped = load_jsonl_examples(path)
    assert skipped == 0 and len(examples) == 2
    examples, skipped = load_jsonl_examples(path, checks=row_checks({"format": "algorithm.rewards"}))
    assert skipped == 0 and len(examples) == 2  # format reads the completion only


def test_advice_never_drops_every_row(tmp_path):
    """Issue #27: rows {"prompt", "solution"} got the advice `set data.on_bad_row: skip`, which drops them all."""
    path = write_lines(tmp_path, [json.dumps({"prompt": f"Q{i}?", "solution": "5"}) for i in range(3)])
    with pytest.raises(DataError) as info:
        load_jsonl_examples(path)
    message = str(info.value)
    assert message.startswith(f"{path}:1: no prompt column 'question' (data.prompt_field (unset, so "
                              f"data.question_field 'question')); the row has keys ['prompt', 'solution']: set "
                              f"data.prompt_field: prompt (all 3 rows are refused, so data.on_bad_row: skip would "
                              f"drop every one")
    examples, _ = load_jsonl_examples(path, prompt_field="prompt")
    assert [e.prompt for e in examples] == ["Q0?", "Q1?", "Q2?"] and examples[0].columns == {"solution": "5"}


def test_skip_mode_counts_bad_rows_and_keeps_indices(tmp_path):
    path = write_lines(tmp_path, [row("A?"), BAD_ROWS[0][0], "", BAD_ROWS[1][0], row("B?")])
    examples, skipped = load_jsonl_examples(path, on_bad_row="skip", checks=ACCURACY)
    assert skipped == 2
    assert [(e.index, e.question) for e in examples] == [(0, "A?"), (3, "B?")]


def test_reference_without_a_number_is_skipped_and_counted(tmp_path):
    path = write_lines(tmp_path, [row("A?"), row("B?", "#### five"), row("C?", "#### $1,000.")])
    examples, skipped = load_jsonl_examples(path, on_bad_row="skip", checks=ACCURACY)
    assert skipped == 1
    assert [(e.index, e.reference) for e in examples] == [(0, "5"), (2, "$1,000.")]


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b""])
def test_invalid_json_column_is_within_the_line(tmp_path, ending):
    line = b'  {"question": "Q?", "answer": "#### 5"'  # unclosed object: the error is just past its last character
    path = tmp_path / "data.jsonl"
    path.write_bytes(row().encode() + b"\n" + line + ending)
    with pytest.raises(DataError, match=rf"data.jsonl:2: invalid JSON: Expecting ',' delimiter at column "
                                        rf"{len(line) + 1} "):
        load_jsonl_examples(path)
    path.write_bytes(b'{"question": "Q?" "answer": "#### 5"}' + ending)
    with pytest.raises(DataError, match=r"data.jsonl:1: invalid JSON: Expecting ',' delimiter at column 19 "):
        load_jsonl_examples(path)


def test_only_bad_rows_is_an_error(tmp_path):
    path = write_lines(tmp_path, ["{", "[]"])
    with pytest.raises(DataError, match=r"no usable rows \(2 bad rows skipped") as info:
        load_jsonl_examples(path, on_bad_row="skip")
    assert ". Point data.train_path" in str(info.value)  # the advice is a sentence of its own


def test_missing_file_says_how_to_get_data(tmp_path):
    with pytest.raises(DataError) as info:
        load_jsonl_examples(tmp_path / "nope.jsonl")
    msg = str(info.value)
    assert "nope.jsonl not found" in msg
    assert "data.train_path" in msg and "question" in msg and "gsm8k" in msg.lower()


def test_extract_reference_uses_last_marker():
    assert extract_reference("a #### 1\nb #### 2 ") == "2"
    with pytest.raises(ValueError):
        extract_reference("no marker")


@pytest.mark.skipif(not GSM8K_TRAIN.is_file(), reason="shared GSM8K copy not present")
def test_real_gsm8k_train_loads():
    examples, skipped = load_jsonl_examples(GSM8K_TRAIN)
    assert (len(examples), skipped) == (7473, 0)
    assert examples[0].reference == "72"


def make_examples(n):
    return [Example(i, f"q{i}", f"#### {i}", str(i)) for i in range(n)]


def indices(batch):
    return [e.index for e in batch]


def test_sampler_is_deterministic_and_covers_each_epoch():
    a, b = PromptSampler(make_examples(10), 5, seed=3), PromptSampler(make_examples(10), 5, seed=3)
    first = [indices(a.next_batch()) for _ in range(4)]
    assert first == [indices(b.next_batch()) for _ in range(4)]
    assert sorted(first[0] + first[1]) == list(range(10))
    assert sorted(first[2] + first[3]) == list(range(10))
    assert first[0] + first[1] != first[2] + first[3]  # a new permutation each epoch
    other = PromptSampler(make_examples(10), 5, seed=4)
    assert [indices(other.next_batch()) for _ in range(2)] != first[:2]


def test_sampler_epoch_boundary_takes_rest_then_next_epoch():
    sampler = PromptSampler(make_examples(5), 3, seed=0)
    order0, order1 = sampler.epoch_order(0), sampler.epoch_order(1)
    assert indices(sampler.next_batch()) == order0[:3]
    assert indices(sampler.next_batch()) == order0[3:] + order1[:1]
    assert (sampler.epoch, sampler.offset) == (1, 1)
    big = PromptSampler(make_examples(2), 5, seed=1)
    assert indices(big.next_batch()) == big.epoch_order(0) + big.epoch_order(1) + big.epoch_order(2)[:1]


def test_sampler_without_shuffle_is_file_order():
    sampler = PromptSampler(make_examples(4), 3, seed=9, shuffle=False)
    assert [indices(sampler.next_batch()) for _ in range(2)] == [[0, 1, 2], [3, 0, 1]]


def test_sampler_state_round_trip_resumes_exactly():
    reference = PromptSampler(make_examples(7), 3, seed=11)
    expected = [indices(reference.next_batch()) for _ in range(6)]
    first = PromptSampler(make_examples(7), 3, seed=11)
    for _ in range(4):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptSampler(make_examples(7), 3, seed=11)
    resumed.load_state_dict(state)
    assert [indices(resumed.next_batch()) for _ in range(2)] == expected[4:]


def test_sampler_state_mismatch_is_an_error():
    state = PromptSampler(make_examples(7), 3, seed=11).state_dict()
    with pytest.raises(ValueError, match=r"num_examples: expected 8 \(this sampler\), got 7"):
        PromptSampler(make_examples(8), 3, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seed: expected 12"):
        PromptSampler(make_examples(7), 3, seed=12).load_state_dict(state)


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one example"):
        PromptSampler([], 2, seed=0)
    with pytest.raises(ValueError, match="batch_size >= 1, got 0"):
        PromptSampler(make_examples(2), 0, seed=0)


def test_build_chat_prompt():
    example = make_examples(1)[0]
    assert build_chat_prompt(example, "Be brief.", "\nAnswer with ####.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q0\nAnswer with ####."},
    ]
    assert build_chat_prompt(example, None, "") == [{"role": "user", "content": "q0"}]


def test_tiny_test_spec_reads_the_gsm8k_beside_the_repository(gsm8k_train_path, tmp_path):
    """``tests/tiny_cpu.yaml``'s relative data path resolves against the file's folder, to
    ../shared/data/gsm8k beside the repository (what the real-loop tests in tests/ray train on)."""
    from cluster.spec import load_spec

    if not (BESIDE / "gsm8k" / "train.jsonl").is_file():
        pytest.skip(f"no ../shared/data/gsm8k beside this checkout ({BESIDE}): the test spec's relative path points "
                    f"there")

    spec = load_spec(Path(__file__).resolve().parents[2] / "tests" / "tiny_cpu.yaml", [f"output_dir={tmp_path}"])
    assert Path(spec.data.train_path).resolve() == gsm8k_train_path.resolve()


def test_an_error_names_the_first_few_refused_rows_not_only_the_first(tmp_path):
    """A file with seven bad rows among good ones: the error gives the first in full, the next four by file:line and
    reason, and how many more there are, so one edit can fix them all; one bad row adds nothing."""
    lines = [row()]
    for i in range(7):
        lines += [json.dumps({"question": f"Q{i}?", "answer": f"#### x{i}"}), row()]
    path = write_lines(tmp_path, lines)
    with pytest.raises(DataError) as info:
        load_jsonl_examples(path, checks=ACCURACY)
    message = str(info.value)
    assert message.startswith(f"{path}:2: ") and "(7 of 15 rows are refused;" in message
    others = message.split(". Also refused: ", 1)[1]
    assert re.findall(rf"{re.escape(str(path))}:(\d+): ", others) == ["4", "6", "8", "10"]
    assert "got 'x1'" in others and others.endswith(" (and 2 more)"), others
