"""Issue #35, item 1: a verifier pays an answer only when the completion commits to one final answer equivalent to the
reference (STYLE rule 18); a hedge — the right value put forward together with a wrong one — is wrong. The rule is
``grpo.rewards.final_answer``'s; every answer verifier applies it: ``accuracy`` (GSM8K), ``reasoning_gym`` (the
demo's chain_sum, last-number extraction), ``math`` (math-verify in its worker), the own-task example's ``correct``
(examples/own_task/reward.py), and held-out evaluation through them.

Table-driven by kind. A hedge template holds ``{a}`` and ``{b}``; each is tried both ways round, with ``a`` the right
value and ``b`` a wrong one and the other way, so neither the first nor the last value of a hedge is ever paid. The
converse tables hold what must still pay: an answer restated, written with units or currency, or after a worked
solution full of other numbers; and, where the reference itself is several values, the list that is the answer.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster.loop.evaluation import score_problems
from contract.messages import GroupResult
from grpo.rewards import REWARD_FUNCTIONS, accuracy_reward, format_reward

REPO = Path(__file__).resolve().parents[2]
RIGHT, WRONG = "3", "4"

#: kind → hedge templates ({a}, {b}: two different values; tried both ways round).
HEDGES: dict[str, list[str]] = {
    "several_boxes": [
        "\\boxed{{{a}}}\n\nLet me double-check. \\boxed{{{b}}}",
        "So x = \\boxed{{{a}}}. Hmm, wait: x = \\boxed{{{b}}}.",
        "\\fbox{{{a}}} \\boxed{{{b}}}",
        "$\\boxed{{{a}}}$ $\\boxed{{{b}}}$",
        "\\boxed{{{a}}}\\boxed{{{b}}}",
    ],
    "boxes_joined": [
        "\\boxed{{{a}}} or \\boxed{{{b}}}",
        "The answer is \\boxed{{{a}}} or \\boxed{{{b}}}.",
        "$\\boxed{{{a}}}$ and $\\boxed{{{b}}}$",
        "\\boxed{{{a}}}, \\boxed{{{b}}}",
    ],
    "alternatives_in_box": [
        "\\boxed{{{a} \\text{{ or }} {b}}}",
        "\\boxed{{{a} or {b}}}",
        "\\boxed{{{a}, {b}}}",
        "\\boxed{{{a}; {b}}}",
        "\\boxed{{{a} \\text{{ and }} {b}}}",
        "\\boxed{{{a} \\lor {b}}}",
        "\\boxed{{\\{{{a}, {b}\\}}}}",
        "\\boxed{{x = {a} \\text{{ or }} x = {b}}}",
        "\\boxed{{x = {a}, x = {b}}}",
        "\\boxed{{{a} \\text{{ (or }} {b})}}",
        "\\boxed{{\\pm {a}}}",
        "\\boxed{{{a} \\pm {b}}}",
        "\\boxed{{±{a}}}",
    ],
    "marker_line_alternatives": [
        "#### {a} or {b}",
        "#### {a}, {b}",
        "#### {a} (or {b})",
        "#### {a} or maybe {b}",
        "#### {a}, possibly {b}",
        "#### {a} / {b}",
        "#### either {a} or {b}",
        "#### +/-{a}",
        "#### {a} ({b})",
        "#### {a} ({b}?)",
        "#### {a} and {b}",
    ],
    "phrase_alternatives": [
        "the answer is {a} (or maybe {b})",
        "The answer is {a}, or perhaps {b}.",
        "The final answer is either {a} or {b}.",
        "Answer: {a} or {b}",
        "**Final Answer:** {a}, {b}",
        "The answer is likely {a}, but could be {b}.",
        "So the answer is {a}? Or {b}?",
    ],
    "two_final_markers": [
        "#### {a}\n#### {b}",
        "#### {a}\nwait, no\n#### {b}",
        "<answer>{a}</answer> <answer>{b}</answer>",
        "<answer>{a}</answer>\n#### {b}",
        "The final answer is {a}.\nThe final answer is {b}.",
        "Answer: {a}\nAnswer: {b}",
    ],
    "candidate_list": [
        "It is either 12, 13 or {a}, {b}.",
        "either {b}, 13 or {a}",
        "It is {a}, {b} or 17.",
        "Possible values: {a}, {b}",
        "It could be {b}, {a}",
        "It's {a}. Or is it {b}?",
        "I get {a}; maybe {b}.",
    ],
    "restated_differently": [
        "#### {a}\nSo the answer is {b}.",
        "\\boxed{{{a}}}\nThe final answer is {b}.",
        "The answer is {a}.\n#### {b}",
        "\\boxed{{{a}}}\n#### {b}",
        "So the answer is {a}. Actually, the answer is {b}.",
    ],
    "range": [
        "The answer is between {a} and {b}.",
        "It is between {a} and {b}",
        "#### {a}-{b}",
        "#### {a} to {b}",
        "#### {a}–{b}",
        "\\boxed{{{a} \\text{{ to }} {b}}}",
    ],
    "trailing_alternative": [
        "\\boxed{{{a}}}. Or maybe {b}.",
        "#### {a}\nOr {b}.",
        "The answer is {a}. Alternatively, {b}.",
        "The answer is {a}. Perhaps {b}, though.",
        "\\boxed{{{a}}} (or possibly {b})",
    ],
}

#: kind → completions that commit to {a}, the right value: every verifier pays them.
COMMITTED: dict[str, list[str]] = {
    "restated": [
        "\\boxed{{{a}}}\n\nSo the answer is \\boxed{{{a}}}.",
        "#### {a}\n#### {a}",
        "The answer is {a}.\n#### {a}",
        "#### {a}\nThe answer is indeed {a}.",
        "<answer>{a}</answer> <answer>{a}</answer>",
        "\\boxed{{{a}}} or, written out, \\boxed{{{a}.0}}",
        "The answer is {a}, or equivalently {a}.0.",
    ],
    "worked_solution": [
        "She has 12 apples and gives away 9, so 12 - 9 = {a}.\n#### {a}",
        "12 - 9 = {a}, so the answer is \\boxed{{{a}}}.",
        "First 5 + 7 = 12, then 12 - 9 = {a}. The answer is {a}.",
        "So 12 - 9 = {a}.",
        "Is it 2 or 4? Neither: 12 - 9 = {a}.\n#### {a}",
        "We add 1 and 2, which gives {a}.",
        "The answer is 12 - 9 = {a}.",
        "<think>Maybe 2 or 4... \\boxed{{2}}? No.</think>\n12 - 9 = {a}, so \\boxed{{{a}}}.",
    ],
    "with_units": [
        "\\boxed{{{a} \\text{{ apples}}}}",
        "The answer is {a} apples.",
        "So she has {a} apples left.",
    ],
}

#: With units or currency on a "####" line, which reasoning-gym's decimal scorer reads as the whole string (so it pays
#: them part of a point, not full credit, as before): the GSM8K checker and math-verify pay them.
COMMITTED_NUMERIC_ONLY: dict[str, list[str]] = {
    "with_units": ["#### ${a}", "#### {a} dollars", "#### {a}.", "\\boxed{{\\${a}}}", "The answer is ${a}.00."],
}


def _both_ways(templates: list[str]) -> list[str]:
    return [t.format(a=a, b=b) for t in templates for a, b in ((RIGHT, WRONG), (WRONG, RIGHT))]


def _committed(templates: list[str]) -> list[str]:
    return [t.format(a=RIGHT) for t in templates]


# ---- the GSM8K checker (``accuracy``) ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(HEDGES))
def test_hack_hedges_accuracy_pays_no_hedge(kind):
    paid = [c for c in _both_ways(HEDGES[kind]) if accuracy_reward(c, RIGHT) != 0.0]
    assert not paid, f"accuracy paid these {kind} hedges: {paid}"


@pytest.mark.parametrize("kind", sorted(COMMITTED))
def test_hack_hedges_accuracy_pays_a_committed_answer(kind):
    completions = _committed(COMMITTED[kind] + COMMITTED_NUMERIC_ONLY.get(kind, []))
    unpaid = [c for c in completions if accuracy_reward(c, RIGHT) != 1.0]
    assert not unpaid, f"accuracy refused these committed answers: {unpaid}"


def test_hack_hedges_format_pays_no_hedged_solution():
    """The format rule's answer line must be the completion's one final answer: a box or an answer phrase in the
    reasoning that names another value is a second final answer."""
    work = "She buys 3 packs of 4 pens, so 3 * 4 = 12 pens.\n"
    assert format_reward(work + "#### 12") == 1.0
    assert format_reward(work + "The answer is 12.\n#### 12") == 1.0
    for hedge in ("\\boxed{13}\n", "The answer is 13.\n", "The final answer is 12 or 13.\n", "Answer: 12, 13\n"):
        assert format_reward(work + hedge + "#### 12") == 0.0, hedge


# ---- reasoning-gym (the demo's reward: chain_sum, last-number extraction) ------------------------------------------
def _chain_sum_reference(answer_extraction: str = "last_number") -> str:
    """chain_sum item 1 of seed 0 ('4 - 1 ='), whose answer is RIGHT."""
    from grpo.rewards.reasoning_gym import encode_reference, generate_entries

    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    assert generate_entries("chain_sum", config, 0, 2)[1]["answer"] == RIGHT
    return encode_reference("chain_sum", config, 0, 2, 1, answer_extraction)


@pytest.mark.parametrize("kind", sorted(HEDGES))
def test_hack_hedges_reasoning_gym_pays_no_hedge(kind):
    pytest.importorskip("reasoning_gym")
    from grpo.rewards.reasoning_gym import score_completion

    for extraction in ("last_number", "marker"):
        reference = _chain_sum_reference(extraction)
        paid = [c for c in _both_ways(HEDGES[kind]) if score_completion(c, reference) != 0.0]
        assert not paid, f"reasoning_gym ({extraction}) paid these {kind} hedges: {paid}"


@pytest.mark.parametrize("kind", sorted(COMMITTED))
def test_hack_hedges_reasoning_gym_pays_a_committed_answer(kind):
    pytest.importorskip("reasoning_gym")
    from grpo.rewards.reasoning_gym import score_completion

    reference = _chain_sum_reference()
    unpaid = [c for c in _committed(COMMITTED[kind]) if score_completion(c, reference) != 1.0]
    assert not unpaid, f"reasoning_gym refused these committed answers: {unpaid}"


def test_hack_hedges_reasoning_gym_text_answers():
    """A task whose answer is a word (spell_backward): two different final answers are a hedge, one restated is not."""
    pytest.importorskip("reasoning_gym")
    from grpo.rewards.reasoning_gym import encode_reference, generate_entries, score_completion

    answer = generate_entries("spell_backward", {}, 0, 1)[0]["answer"]
    reference = encode_reference("spell_backward", {}, 0, 1, 0)
    assert score_completion(f"#### {answer}", reference) == 1.0
    assert score_completion(f"#### {answer}\n#### {answer}", reference) == 1.0
    assert score_completion(f"The answer is {answer}.\n#### {answer}", reference) == 1.0
    for hedge in (f"#### {answer}x\n#### {answer}", f"<answer>{answer}</answer><answer>nus</answer>",
                  f"#### nus\n#### {answer}", f"The answer is nus.\n#### {answer}"):
        assert score_completion(hedge, reference) == 0.0, hedge


# ---- math (math-verify in its worker process) ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def math_scores():
    """Every math case scored in one batch (one worker process): {(reference, completion): score}."""
    pytest.importorskip("math_verify")
    cases = [(RIGHT, c) for kind in HEDGES for c in _both_ways(HEDGES[kind])]
    cases += [(RIGHT, c) for kind in COMMITTED for c in _committed(COMMITTED[kind] + COMMITTED_NUMERIC_ONLY.get(
        kind, []))]
    cases += [(ref, c) for ref, c, _ in MATH_SEVERAL_VALUES]
    scores = REWARD_FUNCTIONS["math"]([c for _, c in cases], [r for r, _ in cases])
    return dict(zip(cases, scores))


@pytest.mark.parametrize("kind", sorted(HEDGES))
def test_hack_hedges_math_pays_no_hedge(kind, math_scores):
    paid = [c for c in _both_ways(HEDGES[kind]) if math_scores[(RIGHT, c)] != 0.0]
    assert not paid, f"math paid these {kind} hedges: {paid}"


@pytest.mark.parametrize("kind", sorted(COMMITTED))
def test_hack_hedges_math_pays_a_committed_answer(kind, math_scores):
    completions = _committed(COMMITTED[kind] + COMMITTED_NUMERIC_ONLY.get(kind, []))
    unpaid = [c for c in completions if math_scores[(RIGHT, c)] != 1.0]
    assert not unpaid, f"math refused these committed answers: {unpaid}"


#: (reference, completion, score): where the reference is itself several values (a set, a tuple, an interval, ±), the
#: list, the "or" and the ± are the answer, judged against it; still one final answer only.
MATH_SEVERAL_VALUES = [
    ("\\{3, 4\\}", "\\boxed{3, 4}", 1.0),
    ("\\{3, 4\\}", "\\boxed{\\{4, 3\\}}", 1.0),
    ("\\{3, 4\\}", "\\boxed{3 \\text{ or } 4}", 1.0),
    ("\\{3, 4\\}", "x = 3 or x = 4, so \\boxed{x = 3, x = 4}", 1.0),
    ("\\{3, 4\\}", "\\boxed{3, 4, 5}", 0.0),
    ("\\{3, 4\\}", "\\boxed{3, 4} or \\boxed{3, 5}", 0.0),
    ("\\{3, 4\\}", "\\boxed{3}", 0.0),
    ("\\pm 3", "\\boxed{\\pm 3}", 1.0),
    ("(3, 4)", "\\boxed{(3, 4)}", 1.0),
    ("(3, 4)", "\\boxed{(4, 3)}", 0.0),
    ("[3, 4]", "\\boxed{[3, 4]}", 1.0),
    ("[3, 4]", "\\boxed{[3, 4]}. Or maybe \\boxed{[3, 5]}.", 0.0),
    ("\\frac{3}{4}", "\\boxed{3/4}", 1.0),
    ("\\frac{3}{4}", "\\boxed{\\frac{3}{4}}", 1.0),
    ("3", "\\boxed{3/4}", 0.0),
    ("3", "\\boxed{6/2}", 1.0),
    ("3", "\\boxed{5-2}", 1.0),
]


def test_hack_hedges_math_several_valued_references(math_scores):
    wrong = [(r, c, math_scores[(r, c)]) for r, c, s in MATH_SEVERAL_VALUES if math_scores[(r, c)] != s]
    assert not wrong, f"(reference, completion, score) scored otherwise: {wrong}"


# ---- a reward of one's own: the own-task example's ``correct`` (examples/own_task/reward.py) -----------------------
@pytest.fixture(scope="module")
def own_task_correct():
    """``correct`` of examples/own_task/reward.py, loaded from its file as the spec names it."""
    from grpo.rewards.loading import load_reward

    return load_reward("reward.py:correct", REPO / "examples" / "own_task")


@pytest.mark.parametrize("kind", sorted(HEDGES))
def test_hack_hedges_own_task_correct_pays_no_hedge(kind, own_task_correct):
    completions = _both_ways(HEDGES[kind])
    paid = [c for c, s in zip(completions, own_task_correct(completions, [RIGHT] * len(completions))) if s != 0.0]
    assert not paid, f"the own-task example's correct paid these {kind} hedges: {paid}"


@pytest.mark.parametrize("kind", sorted(COMMITTED))
def test_hack_hedges_own_task_correct_pays_a_committed_answer(kind, own_task_correct):
    completions = _committed(COMMITTED[kind] + COMMITTED_NUMERIC_ONLY.get(kind, []))
    unpaid = [c for c, s in zip(completions, own_task_correct(completions, [RIGHT] * len(completions))) if s != 1.0]
    assert not unpaid, f"the own-task example's correct refused these committed answers: {unpaid}"


def test_hack_hedges_own_task_correct_reads_the_committed_answer_not_the_last_number(own_task_correct):
    """Issue 35 item 1's case: "it is 12 or maybe 15" is no answer, whichever of the two the row expects; a committed
    answer followed by its working ("#### 13 (8 + 5)") is 13, not the last number 5."""
    completions = ["it is 12 or maybe 15", "it is 12 or maybe 15", "#### 13 (8 + 5)", "8 + 5 = 13\n13"]
    assert own_task_correct(completions, ["15", "12", "13", "13"]) == [0.0, 0.0, 1.0, 1.0]


# ---- held-out evaluation gives the same verdict --------------------------------------------------------------------
def _groups(texts: list[str]) -> list[GroupResult]:
    return [GroupResult(i, [1], [[5]], [None], ["stop"], [t], 0) for i, t in enumerate(texts)]


def test_hack_hedges_held_out_evaluation_counts_no_hedge():
    """pass@1 counts a completion correct exactly when the training reward pays it: hedges are wrong there too."""
    hedges = [c for kind in HEDGES for c in _both_ways(HEDGES[kind])]
    committed = [c for kind in COMMITTED for c in _committed(COMMITTED[kind])]
    texts = hedges + committed
    rows = [RIGHT] * len(texts)  # a bare reference stands for a row with only a reference
    scores = score_problems(_groups(texts), rows, "accuracy", None)
    assert [c[0] for c in scores.correct] == [0.0] * len(hedges) + [1.0] * len(committed)
    assert [c[0] for c in scores.correct] == [accuracy_reward(t, RIGHT) for t in texts]


def test_hack_hedges_held_out_evaluation_reasoning_gym():
    pytest.importorskip("reasoning_gym")
    reference = _chain_sum_reference()
    texts = ["#### 4\n#### 3", "either 4 or 3", "12 - 9 = 3.", "\\boxed{3} or \\boxed{4}"]
    rows = [reference] * len(texts)
    scores = score_problems(_groups(texts), rows, "reasoning_gym", None)
    assert [c[0] for c in scores.correct] == [0.0, 0.0, 1.0, 0.0]


# ---- the rule keeps the verifiers linear ---------------------------------------------------------------------------
ONE_MB = 1_000_000


@pytest.mark.parametrize("name, text", [
    ("boxes", "\\boxed{3}" * (ONE_MB // 9)),
    ("different boxes", "".join(f"\\boxed{{{i}}}" for i in range(ONE_MB // 12))),
    ("nested boxes", "\\boxed{" * (ONE_MB // 14) + "3" + "}" * (ONE_MB // 14)),
    ("marker lines", "#### 3\n" * (ONE_MB // 7)),
    ("answer phrases", "The answer is 3 " * (ONE_MB // 16)),
    ("hedged phrases", "the answer is 3 or 4. " * (ONE_MB // 22)),
    ("tags", "<answer>3</answer>" * (ONE_MB // 18)),
    ("open tags", "<answer>" * (ONE_MB // 8)),
    ("hedge words", "Or maybe 3. " * (ONE_MB // 12)),
    ("a list", "3, " * (ONE_MB // 3)),
])
def test_hack_hedges_rule_is_linear_time(name, text):
    """A megabyte of statements, nested or restated, is scored in about a second, not minutes (each statement is cut
    from the text once and read once per distinct text), and the math reward's plan of what to verify likewise."""
    from sandbox.math_reward import final_statements

    t0 = time.thread_time()
    accuracy_reward(text, RIGHT)
    format_reward(text)
    final_statements(text)
    assert time.thread_time() - t0 < 3.0, name
