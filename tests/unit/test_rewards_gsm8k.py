"""Unit tests for grpo.rewards.gsm8k: answer extraction on awkward completions, references, rewards."""

import json
from pathlib import Path

import pytest

from grpo.rewards.gsm8k import accuracy_reward, extract_answer, format_reward, normalize_number, parse_reference

GSM8K_TEST = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"
NATALIA = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 1,234.", "1234"),
        ("#### $1,000", "1000"),
        ("#### \\$1,000", "1000"),
        ("\\boxed{\\frac{1}{2}}", "1/2"),
        ("#### 18 dollars", "18"),
        ("#### 5\n\nSome trailing text 7", "5"),
        ("She loses money: #### -3", "-3"),
        ("10 - 13 = -3", "-3"),
        ("x = \u22123", "-3"),
        ("5-3 = 2", "2"),
        ("#### +5", "5"),
        ("#### 18.00", "18"),
        ("It costs $18.00.", "18"),
        ("#### 0.50", "0.5"),
        ("#### .5", "0.5"),
        ("#### 18.0", "18"),
        ("#### 007", "7"),
        ("A discount of 25%", "25"),
        ("#### 3\nwait, no\n#### 4", "4"),
        ("#### 3\n#### none", "3"),
        ("So 2 + 2 = 4 and \\boxed{\\text{9 apples}} then 11", "9"),
        ("\\boxed{x = \\dfrac{3}{4}}", "3/4"),
        ("\\boxed{\\frac12}", "1/2"),
        ("\\boxed{1{,}000}", "1000"),
        ("first \\boxed{1} then \\boxed{{2}+{3}=5}", "5"),
        ("\\boxed{12 \\text{ dollars}}", "12"),
        ("\\boxed{unbalanced 3", "3"),
        ("1,2,3", "3"),
        ("abc123 is not a number", None),
        ("no number here", None),
        ("", None),
        ("####", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_is_deterministic():
    text = "Let me think. 3 + 4 = 7. \\boxed{7}\n#### 7"
    assert {extract_answer(text) for _ in range(5)} == {"7"}


@pytest.mark.parametrize(
    "num, den, expected",
    [("1,000", None, "1000"), ("-0", None, "0"), ("+2.50", None, "2.5"), ("1", "2", "1/2"), ("3.0", "4", "3/4")],
)
def test_normalize_number(num, den, expected):
    assert normalize_number(num, den) == expected


def test_parse_reference():
    assert parse_reference(NATALIA) == "72"
    assert parse_reference("72") == "72"
    assert parse_reference("1,000") == "1000"
    assert parse_reference("blah #### 5\n#### -12") == "-12"
    with pytest.raises(ValueError, match="no number"):
        parse_reference("blah #### none")


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("Natalia sold 24 in May, so 72 in total.\n#### 72", NATALIA, 1.0),
        ("#### 71", NATALIA, 0.0),
        ("The answer is 1,234.", "1234", 1.0),
        ("#### $1,000", "1000", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("#### 18 dollars", "18", 1.0),
        ("#### 18.00", "18", 1.0),
        ("#### 5\n\nSome trailing text 7", "5", 1.0),
        ("#### 5\n\nSome trailing text 7", "7", 0.0),
        ("#### -3", "-3", 1.0),
        ("#### 3", "-3", 0.0),
        ("#### 3\n#### 4", "4", 1.0),
        ("#### 3\n#### 4", "3", 0.0),
        ("I don't know.", "5", 0.0),
        ("#### 0.3333333", "1/3", 1.0),
        ("#### 0.33", "1/3", 0.0),
        ("#### 1/0", "5", 0.0),
        ("#### 1000000.0000001", "1000000", 1.0),
    ],
)
def test_accuracy_reward(completion, reference, expected):
    assert accuracy_reward(completion, reference) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("reasoning\n#### 72", 1.0),
        ("reasoning\n#### 72  \n\n  ", 1.0),
        ("reasoning\n#### 72.", 1.0),
        ("reasoning\nSo the answer is #### -1,234.5", 1.0),
        ("reasoning\n#### $18", 1.0),
        ("#### 72\nmore text", 0.0),
        ("reasoning\n#### 18 dollars", 0.0),
        ("reasoning\n#### ", 0.0),
        ("The answer is 72", 0.0),
        ("", 0.0),
        ("   \n  ", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(completion) == expected


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"{GSM8K_TEST} not present")
def test_every_gsm8k_reference_solution_scores_full_marks():
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
    assert len(rows) > 1000
    for row in rows:
        answer = row["answer"]
        parse_reference(answer)
        assert accuracy_reward(answer, answer) == 1.0, answer[-60:]
        assert format_reward(answer) == 1.0, answer[-60:]
