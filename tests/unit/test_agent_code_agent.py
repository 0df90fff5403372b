"""The coding agent (examples/code_agent: written with the openai client) on scripted replies through the agent
endpoint (tests/scripted_agent.py: the real endpoint over a scripted engine): a right first answer, a wrong one fixed
after the failures are shown (the second call extends the first: one training sequence), three wrong ones, a sandbox
failure (no reward); and its spec validates. The agent's tests run in the sandbox: needs bwrap. ~10 s here."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from cluster.agents.loading import check_agent_signature, load_agent
from cluster.data.code_functions import code_function_rows
from cluster.spec import load_spec
from sandbox.test_report import TestReport
from tests.scripted_agent import scripted_episode

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed (Debian package "
                                "bubblewrap; scripts/install_test_tools.sh installs it)")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "code_agent"
ROW = {"prompt": "Write a Python function `add_number(x)` that returns x plus 7.", "reference": "",
       "tests": [{"args": [3], "expected": 10}, {"args": [-2], "expected": 5}, {"args": [0], "expected": 7}],
       "entry_point": "add_number", "family": "add_k", "solution": "def add_number(x):\n    return x + 7\n"}
RIGHT = "```python\ndef add_number(x):\n    return x + 7\n```"
WRONG = "```python\ndef add_number(x):\n    return x + 6\n```"
BROKEN = "```python\ndef add_number(x:\n    return x\n```"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def agent():
    return load_agent("agent.py:run", EXAMPLE)


@pytest.fixture(scope="module")
def spec():
    return load_spec(EXAMPLE / "spec.yaml")


def test_agent_code_agent_spec_validates_and_names_its_agent(spec):
    assert spec.rollout.agent == "agent.py:run" and spec.algorithm.rewards == {}
    assert spec.data.source == "code_functions" and spec.eval is not None and spec.eval.at_start
    run = load_agent("agent.py:run", EXAMPLE)
    assert check_agent_signature(run, "agent.py:run", spec.rollout.agent_options) is None
    source = (EXAMPLE / "agent.py").read_text()
    assert len(source.splitlines()) <= 80  # readable as a user's program


def test_agent_code_agent_right_at_once(spec, tokenizer, agent):
    out, record, seen = scripted_episode(spec, tokenizer, agent, [RIGHT], ROW)
    assert out == {"reward": 1.5, "accuracy": 1.0, "first_try": 1.0, "attempts": 1.0, "ran": 1.0}
    assert len(record.calls) == 1 and seen[0][-1] == {"role": "user", "content": ROW["prompt"]}
    assert seen[0][0]["role"] == "system" and len(seen[0]) == 6  # system, the worked exchange, the task


def test_agent_code_agent_shows_the_failures_and_the_fix_passes(spec, tokenizer, agent):
    out, record, seen = scripted_episode(spec, tokenizer, agent, [WRONG, RIGHT], ROW)
    assert out == {"reward": 1.0, "accuracy": 1.0, "first_try": 0.0, "attempts": 2.0, "ran": 1.0}
    assert seen[1][:-2] == seen[0] and seen[1][-2] == {"role": "assistant", "content": WRONG}
    assert seen[1][-1] == {"role": "user", "content": "The tests failed:\nadd_number(3) returned 9, expected 10\n"
                                                      "add_number(-2) returned 4, expected 5\n(1 more of the 3 "
                                                      "tests failed)\nFix the function."}
    assert [c.extends for c in record.calls] == [False, True]  # one training sequence
    last = record.calls[1]
    assert last.prompt_ids[:len(record.calls[0].prompt_ids)] == record.calls[0].prompt_ids


def test_agent_code_agent_gives_up_after_its_attempts(spec, tokenizer, agent):
    out, record, seen = scripted_episode(spec, tokenizer, agent, [WRONG, BROKEN, WRONG], ROW)
    assert out == {"reward": 0.0, "accuracy": 0.0, "first_try": 0.0, "attempts": 3.0, "ran": 2 / 3}
    assert len(record.calls) == 3 and all(c.extends for c in record.calls[1:])
    assert seen[2][-1]["content"] == ("The tests failed:\nThe program did not run its tests: SyntaxError: '(' was "
                                      "never closed\nFix the function.")
    out, record, _ = scripted_episode(spec, tokenizer, agent, [WRONG, RIGHT], ROW, attempts=1)
    assert out["attempts"] == 1.0 and out["accuracy"] == 0.0 and len(record.calls) == 1


def test_agent_code_agent_sandbox_failure_is_no_reward(spec, tokenizer, agent, monkeypatch):
    down = TestReport("infra_error", (), "")
    monkeypatch.setitem(agent.__globals__, "run_tests", lambda *args, **kw: down)
    out, record, _ = scripted_episode(spec, tokenizer, agent, [RIGHT], ROW)
    assert out is None and len(record.calls) == 1


def test_agent_code_agent_runs_every_generated_row(spec, tokenizer, agent):
    """The rows of data.source code_functions reach the agent whole; their reference solutions pass at once."""
    rows = code_function_rows(spec.data.code_functions, "held_out")[:3]
    for row in rows:
        out, _, _ = scripted_episode(spec, tokenizer, agent, [f"```python\n{row['solution']}```"],
                                     {**row, "reference": ""})
        assert out["accuracy"] == 1.0 and out["attempts"] == 1.0
