"""``data.source: code_functions`` (cluster/data/code_functions.py), the offline code set the coding agent trains on
(examples/code_agent): the same rows from the same settings, held-out functions that no training problem asks for,
every family in both splits, tests that tell each problem's function from every other function of its family, the
reference solutions passing their tests in the sandbox and wrong ones failing, and the spec section's checks. The
sandbox tests need bwrap and skip without it. ~10 s here."""

from __future__ import annotations

import random
import shutil

import pytest

from cluster.data import DataError
from cluster.data.code_families import FAMILIES, FAMILY_NAMES, FunctionTask
from cluster.data.code_functions import (code_function_examples, code_function_rows, family_split,
                                         reference_function)
from cluster.data.sources import describe_source, load_examples
from cluster.spec import SpecError, load_spec
from cluster.spec.data import CodeFunctionsSpec, DataSpec
from grpo.rewards import REWARD_FUNCTIONS
from grpo.rewards.checks import row_checks
from sandbox.config import SandboxConfig

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed (Debian package "
                                 "bubblewrap; scripts/install_test_tools.sh installs it)")
SANDBOX = SandboxConfig(cpu_time_s=2, wall_time_s=10, uid_base=61300, uid_count=64)
CF = CodeFunctionsSpec(size=400, held_out_size=200)
FAMILY = {f.name: f for f in FAMILIES}
BASE = {"output_dir": "out", "total_steps": 1}


def task_of(row: dict) -> FunctionTask:
    """The FunctionTask a row was made from (its reference solution names it)."""
    family = FAMILY[row["family"]]
    (task,) = [t for t in map(family.task, family.params) if t.solution == row["solution"]]
    return task


def test_agent_code_functions_rows_are_deterministic():
    first = code_function_rows(CF, "train")
    assert first == code_function_rows(CodeFunctionsSpec(size=400, held_out_size=200), "train")
    assert code_function_rows(CF, "held_out") == code_function_rows(CF, "held_out")
    assert first[:3] == code_function_rows(CodeFunctionsSpec(size=3), "train")  # item i depends on seed + i only
    assert first != code_function_rows(CodeFunctionsSpec(size=400, seed=1), "train")
    # pinned, so that a change of the generator (or of Python's random) is seen, not silently trained on
    assert first[0]["prompt"] == ("Write a Python function `add_to_each(xs)` that returns a new list with 8 added "
                                  "to every number of the list xs.")
    assert first[0]["entry_point"] == "add_to_each" and first[0]["tests"][0] == {"args": [[1, 8, 16, 15]],
                                                                                 "expected": [9, 16, 24, 23]}


def test_agent_code_functions_held_out_functions_are_never_trained_on():
    train, held = code_function_rows(CF, "train"), code_function_rows(CF, "held_out")
    assert not {r["solution"] for r in train} & {r["solution"] for r in held}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert len({r["prompt"] for r in held}) == len(held)  # each held-out function once
    assert {r["family"] for r in train} == {r["family"] for r in held} == set(FAMILY_NAMES)
    assert [r["family"] for r in held[:len(FAMILIES)]] == list(FAMILY_NAMES)  # the families in turn
    for family in FAMILIES:
        kept, out = family_split(family, CF.held_out_fraction, CF.split_seed)
        assert kept and out and not set(kept) & set(out) and sorted(map(repr, kept + out)) == sorted(
            map(repr, family.params))
    other = code_function_rows(CodeFunctionsSpec(size=400, held_out_size=200, split_seed=1), "held_out")
    assert {r["solution"] for r in other} != {r["solution"] for r in held}  # split_seed moves the split
    assert len(code_function_rows(CodeFunctionsSpec(held_out_size=5), "held_out")) == 5


def test_agent_code_functions_tests_tell_each_function_from_its_family():
    rows = code_function_rows(CF, "train") + code_function_rows(CF, "held_out")
    for row in rows:
        task = task_of(row)
        assert len(row["tests"]) >= CF.tests
        right = reference_function(task)
        for case in row["tests"]:
            assert right(*case["args"]) == case["expected"]
            assert case.get("check", "eq") == ("is" if isinstance(case["expected"], bool) else "eq")
        family = FAMILY[row["family"]]
        for body in {family.task(p).body for p in family.params} - {task.body}:
            wrong = reference_function(FunctionTask(task.name, task.args, "", body))
            assert not all(_passes(wrong, case) for case in row["tests"]), (row["prompt"], body)


def _passes(function, case: dict) -> bool:
    try:
        value = function(*case["args"])
    except Exception:  # noqa: BLE001 - a raising function fails the case
        return False
    return type(value) is type(case["expected"]) and value == case["expected"]


@needs_bwrap
def test_agent_code_functions_reference_passes_in_the_sandbox_and_a_wrong_one_fails():
    rows = code_function_rows(CF, "held_out") + random.Random(0).sample(code_function_rows(CF, "train"), 60)
    completions, tests, names = [], [], []
    for row in rows:
        task = task_of(row)
        family = FAMILY[row["family"]]
        other = next(t for t in map(family.task, family.params) if t.body != task.body)
        wrong = FunctionTask(task.name, task.args, "", other.body).solution
        completions += [f"```python\n{task.solution}```", f"```python\n{wrong}```"]
        tests += [row["tests"]] * 2
        names += [row["entry_point"]] * 2
    scores = REWARD_FUNCTIONS["code"](completions=completions, tests=tests, entry_point=names, sandbox=SANDBOX)
    assert scores[0::2] == [1.0] * len(rows) and scores[1::2] == [0.0] * len(rows)


def test_agent_code_functions_source_loads_through_the_spec():
    data = DataSpec(source="code_functions", code_functions={"size": 50, "held_out_size": 20,
                                                              "families": ["add_k", "string_op"]})
    train, dropped = load_examples(data, "train", row_checks({"code": "algorithm.rewards"}))
    held, _ = load_examples(data, "held_out")
    assert dropped == 0 and len(train) == 50
    assert len(held) == 10 + 4  # every held-out function of add_k and string_op, fewer than held_out_size
    assert {ex.columns["family"] for ex in train} == {"add_k", "string_op"}
    assert train[0].prompt.startswith("Write a Python function `") and train[0].index == 0
    assert set(train[0].columns) == {"tests", "entry_point", "family", "solution"}
    assert describe_source(data) == "code functions (add_k, string_op; seed 0, 50 problems)"
    with pytest.raises(DataError, match="reward 'accuracy'"):
        code_function_examples(data.code_functions, "train", row_checks({"accuracy": "algorithm.rewards"}))


@pytest.mark.parametrize("section, match", [
    ({"source": "code_functions", "code_functions": {"families": ["add_k", "nope"]}}, "unknown families"),
    ({"source": "code_functions", "train_path": "x.jsonl"}, "data.train_path"),
    ({"source": "code_functions", "prompt_field": "question"}, "data.prompt_field"),
    ({"source": "code_functions", "code_functions": {"held_out_fraction": 1.0}}, "held_out_fraction"),
    ({"train_path": "x.jsonl", "code_functions": {"size": 10}}, "data.code_functions.size"),
])
def test_agent_code_functions_spec_refuses_bad_settings(tmp_path, section, match):
    import yaml

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**BASE, "data": section, "algorithm": {"rewards": {"code": 1.0}},
                                    "eval": {"accuracy_reward": "code", "format_reward": None}}))
    (tmp_path / "x.jsonl").write_text('{"question": "q", "tests": [], "entry_point": "f"}\n')
    with pytest.raises(SpecError, match=match):
        load_spec(spec)


def test_agent_code_functions_single_turn_spec_needs_a_code_reward_for_eval(tmp_path):
    import yaml

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**BASE, "data": {"source": "code_functions"},
                                    "algorithm": {"rewards": {"code": 1.0}}, "eval": {"at_start": True}}))
    with pytest.raises(SpecError, match="eval.accuracy_reward"):
        load_spec(spec)
    spec.write_text(yaml.safe_dump({**BASE, "data": {"source": "code_functions"},
                                    "algorithm": {"rewards": {"code": 1.0}},
                                    "eval": {"accuracy_reward": "code", "format_reward": None}}))
    assert load_spec(spec).data.code_functions == CodeFunctionsSpec()
