"""The GSM8K format rule (grpo.rewards.gsm8k.format_reward, rules F1-F5 of its module doc) on hand-built completions:
it pays for a worked solution ending in one answer line, never for the answer line alone."""

import json
import re
from pathlib import Path

import pytest

from grpo.rewards.gsm8k import MIN_REASONING_CHARS, MIN_REASONING_NUMBERS, accuracy_reward, format_reward

GSM8K_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
# 34 non-whitespace characters and 5 numbers (3, 4, 3, 4, 12): meets F4 and F5 for any answer.
WORK = "She buys 3 packs of 4 pens, so 3 * 4 = 12 pens.\n"
NATALIA = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n"


def test_constants_are_the_documented_ones():
    assert (MIN_REASONING_CHARS, MIN_REASONING_NUMBERS) == (30, 3)


@pytest.mark.parametrize("completion", [
    NATALIA + "#### 72",
    NATALIA + "#### 71",  # a wrong answer is still well formed: format and accuracy are separate rewards
    "48/2 = 24 clips in May. 48+24 = 72 in all.\n#### 72",  # short but real
    "Natalia sold 48/2 = 24 clips in May and 48 + 24 = 72 in total, so #### 72",  # reasoning on the marker line
    "Natalia sold 48/2 = 24 clips in May and 48 + 24 = 72 in total.\n\n#### 72\n\n",
    "She sold \\frac{48}{2} = 24 clips in May and 48 + 24 = 72 in all.\n#### 72",
])
def test_worked_solutions_score_one(completion):
    assert format_reward(completion) == 1.0


@pytest.mark.parametrize("completion", [
    "#### 5",  # the CPU demo's hack: the bare answer line
    "#### 5\n",
    "\n\n  #### 5",
    "Let me think step by step.\n#### 5",  # one-line filler, no numbers
    "The answer is 5.\n#### 5",
    "So the final answer, after careful thought, is 5.\n#### 5",  # long enough (F4) but one number (F5)
    "I solved it carefully: it is 5, yes 5.\n#### 5",
])
def test_bare_and_near_bare_answers_score_zero(completion):
    assert format_reward(completion) == 0.0


@pytest.mark.parametrize("completion", [
    WORK + "#### 12\n#### 12",  # the base model does this: "#### 144\n#### 144."
    WORK + "#### 12\n#### 12.",
    "Write a final line '#### <number>'. " + WORK + "#### 12",  # a marker quoted inside the reasoning
    WORK + "##### 12",  # five hashes: the marker is followed by "# 12", which is not a number
    WORK + "########\n#### 12",
])
def test_f1_exactly_one_marker(completion):
    assert format_reward(completion) == 0.0


@pytest.mark.parametrize("completion", [
    WORK + "#### 12\nThe answer is 12.",  # observed in base samples: "#### 80\nthe answer is indeed 80."
    WORK + "#### 12\nThe",
    "#### 12\n" + WORK,  # answer first, work after
])
def test_f2_marker_on_the_last_nonempty_line(completion):
    assert format_reward(completion) == 0.0


@pytest.mark.parametrize("completion, expected", [
    (WORK + "#### 12", 1.0),
    (WORK + "#### 12 pens", 0.0),
    (WORK + "#### twelve", 0.0),
    (WORK + "####", 0.0),
    (WORK + "#### 12 or 13", 0.0),
])
def test_f3_one_parseable_answer(completion, expected):
    assert format_reward(completion) == expected


def reasoning(chars: int) -> str:
    """Reasoning with exactly ``chars`` non-whitespace characters and the numbers 1, 2, 3."""
    core = "1 + 2 = 3"
    return "x" * (chars - len(core.replace(" ", ""))) + " " + core + "\n"


def test_f4_minimum_reasoning_characters():
    assert format_reward(reasoning(MIN_REASONING_CHARS) + "#### 3") == 1.0
    assert format_reward(reasoning(MIN_REASONING_CHARS - 1) + "#### 3") == 0.0
    assert format_reward("1 + 2 = 3\n#### 3") == 0.0
    spaced = "  ".join(reasoning(MIN_REASONING_CHARS - 1)) + "#### 3"  # whitespace does not count
    assert format_reward(spaced) == 0.0


@pytest.mark.parametrize("completion, expected", [
    ("Adding the two amounts together gives 7 and 5 apples.\n#### 12", 0.0),  # 2 numbers
    ("Adding the two amounts together: 7 + 5 = 12 apples.\n#### 12", 1.0),  # 3 numbers
    ("The total is 12, so it is 12, surely 12 apples.\n#### 12", 0.0),  # 3 numbers, all the answer
    ("The total is 12.0, that is 12, or 24/2 apples in all.\n#### 12", 0.0),  # equal in value to the answer
    ("The total is 12.0, that is 12, or 24/3 apples in all.\n#### 12", 1.0),
    ("The amounts are 7 and 5, and together they make twelve.\n#### 12", 0.0),
    ("x" * 40 + " " + "9" * 1001 + " 1 2\n#### 3", 0.0),  # an over-long digit run is no number
])
def test_f5_numbers_in_the_reasoning(completion, expected):
    assert format_reward(completion) == expected


def test_observed_base_model_completions():
    """Excerpts of SmolLM2-135M-Instruct samples (GSM8K train prompts, temperature 1, 128-token cap)."""
    paid = ("The total amount of oil in 24 cans is 24 * 8 = 192 liters.\nThe remaining cans hold 1320 - 72 = 840 "
            "liters of oil.\n#### 840")
    repeated = "Now it will take 2,000 - 16 = 144 hours at the scene watching Jerry.\n#### 144\n#### 144."
    trailing = "So the answer is 30 + 5 = 80 flowers.\n#### 80\nthe answer is indeed 80."
    assert [format_reward(t) for t in (paid, repeated, trailing)] == [1.0, 0.0, 0.0]


def gsm8k_rows(name: str) -> list[dict]:
    path = GSM8K_DIR / f"{name}.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("split, n", [("train", 7473), ("test", 1319)])
def test_every_gsm8k_reference_solution_is_well_formed(split, n):
    """Also without the "<<48/2=24>>" calculator annotations, which a model does not write."""
    rows = gsm8k_rows(split)
    assert len(rows) == n
    for row in rows:
        answer = row["answer"]
        assert format_reward(answer) == 1.0, answer
        assert format_reward(re.sub(r"<<[^<>]*>>", "", answer)) == 1.0, answer
        assert accuracy_reward(answer, answer) == 1.0, answer


def test_bare_reference_answers_score_zero():
    """The hack on real data: each reference's answer line alone is refused; its accuracy is still 1."""
    for row in gsm8k_rows("test")[:200]:
        bare = "#### " + row["answer"].rsplit("####", 1)[1].strip()
        assert format_reward(bare) == 0.0 and accuracy_reward(bare, row["answer"]) == 1.0
