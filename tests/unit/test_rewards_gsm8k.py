"""Unit tests for grpo.rewards.gsm8k: answer extraction on awkward completions, references, rewards."""

import json
import random
import time
from pathlib import Path

import pytest

from grpo.rewards.gsm8k import (MAX_DIGITS, MIN_REASONING_CHARS, MIN_REASONING_NUMBERS, accuracy_reward,
                                committed_answer, extract_answer, format_reward, normalize_number, parse_reference)

GSM8K_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
GSM8K_TEST = GSM8K_DIR / "test.jsonl"
# Reasoning that meets the format rule (34 non-whitespace characters, 5 numbers), before an answer line under test.
WORK = "She buys 3 packs of 4 pens, so 3 * 4 = 12 pens.\n"
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
        ("#### 3\n#### 4", "4", 0.0),  # two final answers: a hedge, whichever is right (issue #35)
        ("#### 3\n#### 4", "3", 0.0),
        ("#### 4\n#### 4", "4", 1.0),  # one answer restated
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
        (WORK + "#### 72", 1.0),
        (WORK + "#### 72  \n\n  ", 1.0),
        (WORK + "#### 72.", 1.0),
        (WORK + "So the answer is #### -1,234.5", 1.0),
        (WORK + "#### $18", 1.0),
        ("#### 72\nmore text", 0.0),
        (WORK + "#### 18 dollars", 0.0),
        (WORK + "#### ", 0.0),
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


def test_long_digit_runs_are_not_numbers_and_never_raise():
    """Python refuses int/str conversions beyond 4300 digits; such runs must not kill a whole batch's scoring."""
    for n in (4301, 100_000):
        long = "1" * n
        for completion in (f"#### {long}", long, f"\\boxed{{{long}}}", f"#### 0.{long}", f"#### {long}/3",
                           f"#### 1/{long}"):
            assert extract_answer(completion) is None
            assert accuracy_reward(completion, "5") == 0.0
            assert format_reward(completion) == 0.0
        assert extract_answer(f"#### 7 {long}") == "7"  # the over-long token is skipped, not truncated
        assert extract_answer(f"7 and {long}") == "7"
        with pytest.raises(ValueError, match="no number"):
            parse_reference(f"#### {long}")
    assert extract_answer("#### " + "9" * MAX_DIGITS) == "9" * MAX_DIGITS
    assert extract_answer("#### " + "9" * (MAX_DIGITS + 1)) is None
    assert normalize_number("0." + "5" * (MAX_DIGITS + 1)) is None


def test_big_numbers_compare_exactly():
    """Floats overflow to inf for both 10**400 and 10**401, which then compared equal."""
    a, b = "#### 1" + "0" * 400, "#### 1" + "0" * 401
    assert accuracy_reward(a, b) == 0.0
    assert accuracy_reward(b, a) == 0.0
    assert accuracy_reward(a, a) == 1.0
    assert accuracy_reward("#### 1" + "0" * 400 + ".0000001", a) == 1.0  # relative tolerance 1e-6 still applies
    assert accuracy_reward("#### 0." + "0" * 400 + "1", "#### 0") == 0.0  # tiny but not zero
    assert accuracy_reward("#### 3/0", "#### 3/0") == 0.0  # x/0 is no value


@pytest.mark.parametrize("text, expected", [
    ("1e400", None),
    ("2.5e3", None),
    ("about 1E+5 of them", None),
    ("The answer is 7, not 3e-2", "7"),
    ("#### 1e400", None),
    ("#### 12 eggs", "12"),
    ("1,000,000e3", None),
])
def test_scientific_notation_is_not_a_number(text, expected):
    assert extract_answer(text) == expected


def test_scientific_notation_reference_is_rejected():
    with pytest.raises(ValueError, match="no number"):
        parse_reference("#### 1e400")
    assert format_reward("#### 2.5e3") == 0.0


def score(text: str) -> float:
    """CPU seconds this thread spends scoring ``text`` (thread time: neither other load on the machine nor other
    threads of the test process, such as a Ray client left by earlier tests, count; the bounds below guard against
    quadratic scans, which cost minutes of CPU on a megabyte, not against a busy machine)."""
    t0 = time.thread_time()
    accuracy_reward(text, "#### 5")
    format_reward(text)
    return time.thread_time() - t0


@pytest.mark.parametrize("name, text", [
    ("many unbalanced boxed", "\\boxed{" * 10_000),
    ("format spaces", "#### 1" + " " * 50_000 + "x"),
    ("frac spaces", "\\frac{" + " " * 3_000),
])
def test_no_quadratic_blow_up(name, text):
    """Sizes where the old regexes / scans took seconds (the frac case grew cubically)."""
    assert score(text) < 1.0, name


ONE_MB = 1_000_000


@pytest.mark.parametrize("name, make", [
    ("digits", lambda n: "1" * n),
    ("many numbers", lambda n: "1 " * (n // 2)),
    ("thousands groups", lambda n: "1" + ",111" * (n // 4) + "e5"),
    ("comma list", lambda n: "1," * (n // 2)),
    ("fractions", lambda n: "1/" * (n // 2)),
    ("markers", lambda n: "#### x " * (n // 7)),
    ("unbalanced boxed", lambda n: "\\boxed{" * (n // 7)),
    ("boxed numbers", lambda n: "\\boxed{" + "1 " * (n // 2)),
    ("format spaces", lambda n: "#### 1" + " " * n + "x"),
    ("frac spaces", lambda n: "\\frac{" + " " * n),
    ("text spaces", lambda n: "\\text{" + " " * n),
    ("signs", lambda n: "-" * n),
    ("sci", lambda n: "2.5e3 " * (n // 6)),
    ("mixed numbers", lambda n: "2 1/2 " * (n // 6)),
    ("mixed digits", lambda n: "1" * (n // 2) + " " + "1" * (n // 2 - 2) + "/3"),
    ("whole and spaces", lambda n: "1" + " " * n + "1/"),
    ("signed currency", lambda n: "-$" * (n // 2) + "5"),
    ("signed currency codes", lambda n: "\u2212USD " * (n // 5) + "5"),
    ("currency symbols", lambda n: "\u20ac" * n + "5"),
    ("prefix before each number", lambda n: "-\u20ac5 " * (n // 4)),
    ("fraction macros", lambda n: "2\\cfrac[l]{1}2 " * (n // 15)),
    ("unclosed fraction macros", lambda n: "\\tfrac{1}" * (n // 9)),
    ("digit frac", lambda n: "2\\frac12" * (n // 8)),
    ("restated answer", lambda n: "5 " * (n // 2) + "\n#### 5"),
    ("distinct numbers", lambda n: " ".join(map(str, range(n // 7))) + "\n#### 5"),
    ("long digit runs", lambda n: ("1" * (MAX_DIGITS + 1) + " ") * (n // (MAX_DIGITS + 2)) + "\n#### 5"),
    ("filler", lambda n: "x" * n + "\n#### 5"),
])
def test_one_megabyte_completion_is_scored_in_seconds_not_minutes(name, make):
    # 3 s, not 1: the restated answer takes 0.90 s of CPU alone here and 1.10 s once in CI; a quadratic scan of a
    # megabyte would take minutes
    assert score(make(ONE_MB)) < 3.0, name


def test_rewards_never_raise_on_random_text():
    pieces = list("0123456789,./+-eE#$ {}\n\\%") + [
        "\\boxed{", "\\fbox{", "\\frac", "\\text{", "####", "\u2212", "{,}", "\\$", "1e400", "\u0663", "\uff13",
        "0" * 1200, "9" * 999]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert accuracy_reward(text, "5") in (0.0, 1.0)
        fmt = format_reward(text)
        assert fmt in (0.0, 1.0)
        answer = committed_answer(text)
        if fmt == 1.0:
            assert answer is not None, text  # a well-formed solution commits to its answer line
        if answer is not None and not answer.endswith("/0"):
            assert accuracy_reward(text, answer) == 1.0, text
        elif extract_answer(text) is not None and not extract_answer(text).endswith("/0"):
            assert accuracy_reward(text, extract_answer(text)) == 0.0, text  # a hedge: what it reads is not paid


@pytest.mark.parametrize("text, expected", [
    ("It takes 2 1/2 hours.\n#### 2 1/2", "5/2"),
    ("\\boxed{2\\frac{1}{2}}", "5/2"),
    ("\\boxed{2\\frac12}", "5/2"),
    ("\\boxed{2 \\dfrac{1}{2}}", "5/2"),
    ("#### -2 1/2", "-5/2"),
    ("#### 1,000 1/4", "4001/4"),
    ("She ran 3 3/4 miles", "15/4"),
    ("#### 3 4/3", "3"),  # an improper fraction after a whole number is no mixed number
    ("#### 2 1/0", "2"),
    ("#### 2 1/2.5", "2"),
    ("1 2", "2"),
])
def test_mixed_numbers(text, expected):
    assert extract_answer(text) == expected


def test_mixed_number_is_not_its_whole_part():
    assert accuracy_reward("It takes 2 1/2 hours.\n#### 2 1/2", "#### 2") == 0.0
    assert accuracy_reward("It takes 2 1/2 hours.\n#### 2 1/2", "2.5") == 1.0
    assert accuracy_reward("\\boxed{2\\frac{1}{2}}", "2.5") == 1.0
    assert accuracy_reward("\\boxed{2\\frac{1}{2}}", "21/2") == 0.0
    assert format_reward(WORK + "#### 2 1/2") == 1.0


@pytest.mark.parametrize("completion", ["#### -$5", "#### \u2212$5", "#### -\\$5", "#### -$ 5", "#### $-5"])
def test_sign_before_currency_belongs_to_the_number(completion):
    assert extract_answer(completion) == "-5"
    assert accuracy_reward(completion, "5") == 0.0
    assert accuracy_reward(completion, "#### -5") == 1.0
    assert format_reward(WORK + completion) == 1.0


def test_minus_between_numbers_before_currency_is_subtraction():
    assert extract_answer("#### 10-$5") == "10"
    assert accuracy_reward("20 - $5 = $15", "15") == 1.0


@pytest.mark.parametrize("completion, reference, expected", [
    ("It takes 2½ hours.\n#### 2½", "2.5", 1.0),
    ("#### 2½", "2", 0.0),  # not its whole part
    ("#### ½", "0.5", 1.0),
    ("#### -2½", "-2.5", 1.0),
    ("#### 3⁄4", "0.75", 1.0),  # U+2044 fraction slash
    ("#### 1 ¾", "1.75", 1.0),
    ("x½ of them, so #### 7", "7", 1.0),
])
def test_unicode_vulgar_fractions_are_fractions(completion, reference, expected):
    assert accuracy_reward(completion, reference) == expected


def test_unicode_vulgar_fractions_are_well_formatted():
    assert format_reward(WORK + "#### 2½") == 1.0
    assert format_reward(WORK + "#### ¾.") == 1.0
    assert extract_answer("#### 2½") == "5/2" and extract_answer("\\boxed{⅓}") == "1/3"
    # linear: one regex pass; each vulgar fraction is read as up to 4 characters (" 1/2"), so the megabyte budget
    # holds for ONE_MB // 4 of them (as for "1/2 " * (ONE_MB // 4) in the megabyte cases above)
    assert score("½" * (ONE_MB // 4)) < 1.0 and score("2½ " * (ONE_MB // 6)) < 1.0

