"""The agent fields of a job spec (``rollout.agent``, ``rollout.agent_options``, ``rollout.agent_pool``,
``rollout.multi_turn.runner``): the agent is imported and its signature checked when the spec is validated, and every
bad input is refused before anything starts, naming the field, the file and the line; conflicting settings are
refused naming the field; ``grpo-cluster validate`` prints the agent and refuses a broken one with exit 2."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.spec import SpecError, load_spec

AGENT = '''\
import asyncio


async def run(client, row, max_turns=2):
    return 1.0


def plain(client, row):
    return 1.0


async def one_arg(client):
    return 1.0


async def gen(client, row):
    yield 1.0
'''
SPEC = """\
output_dir: {out}
total_steps: 1
data: {{train_path: {data}}}
rollout:
  agent: agent.py:run
  agent_options: {{max_turns: 3}}
"""


@pytest.fixture
def spec_file(tmp_path) -> Path:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "broken.py").write_text("import os\n\nvalue = undefined_name + 1\n")
    (tmp_path / "notes.txt").write_text(AGENT)  # an agent's text in a file that is not a .py
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"{i + 1}"}) + "\n"
                            for i in range(4)))
    path = tmp_path / "job.yaml"
    path.write_text(SPEC.format(out=tmp_path / "out", data=data))
    return path


def problem(path: Path, *overrides: str) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides)
    return str(info.value)


def test_agent_spec_loads_the_agent_relative_to_the_spec_file(spec_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # relative to the spec file's folder, not the working folder
    spec = load_spec(spec_file)
    r = spec.rollout
    assert r.agent == "agent.py:run" and r.agent_options == {"max_turns": 3}
    assert (r.agent_pool.workers, r.agent_pool.num_cpus_per_worker, r.agent_pool.timeout_s) == (1, 0.0, 600)
    assert spec.algorithm.rewards == {}  # the agent's return is the reward


@pytest.mark.parametrize("override, field, words", [
    ("rollout.agent=missing.py:run", "rollout.agent", "missing.py not found"),
    ("rollout.agent=broken.py:run", "rollout.agent", "broken.py:3: cannot import"),
    ("rollout.agent=agent.py:nope", "rollout.agent", "has no function 'nope' (it defines: gen, one_arg, plain, run)"),
    ("rollout.agent=agent.py:plain", "rollout.agent",
     "agent.py:8: plain is a plain function (def); expected async def"),
    ("rollout.agent=agent.py:gen", "rollout.agent", "gen is an async generator"),
    ("rollout.agent=agent.py:one_arg", "rollout.agent", "takes 1 positional parameter(s)"),
    ("rollout.agent=no_such_module:run", "rollout.agent", "no module 'no_such_module'"),
    ("rollout.agent=agent.py", "rollout.agent", "expected 'module:function' or 'path/to/file.py:function'"),
    ("rollout.agent=./notes.txt:run", "rollout.agent", "notes.txt is not a Python file (no .py name)"),
    ("rollout.agent_options={turns: 1}", "rollout.agent_options",
     "agent.py:4: cannot be called as run(client, row, **{'turns': 1}): got an unexpected keyword argument 'turns'"),
])
def test_agent_that_cannot_be_used_is_refused_naming_field_file_and_line(spec_file, override, field, words):
    message = problem(spec_file, override)
    assert f"--set {override.split('=')[0]}: " in message and words in message, message
    assert "Traceback" not in message and len(message.splitlines()) == 2


@pytest.mark.parametrize("override, field, words", [
    ("algorithm.rewards={accuracy: 1.0}", "algorithm.rewards", "expected no algorithm.rewards with it"),
    ("rollout.multi_turn={environment: scripted, max_turns: 2, max_episode_tokens: 300}", "rollout.agent",
     "expected one of them, got both"),
    ("rollout.partial_rollout=true", "rollout.partial_rollout", "expected partial_rollout false"),
    ("reward_pool.workers=2", "reward_pool.workers", "expected reward_pool.workers 0 with rollout.agent"),
    ("algorithm.overlong_buffer_tokens=8", "algorithm.overlong_buffer_tokens", "expected null with rollout.agent"),
    ("rollout.max_model_len=1000", "rollout.max_model_len", "rollout.agent_pool.max_episode_tokens"),
    ("rollout.agent_pool.workers=0", "rollout.agent_pool.workers", "greater than or equal to 1"),
    ("rollout.agent_pool.timeout_s=1000", "rollout.agent_pool.timeout_s", "expected agent_pool.timeout_s <= "
     "rollout.timeout_s"),
    ("rollout.agent_pool.resources={CPU: 1}", "rollout.agent_pool.resources", "set rollout.agent_pool.num_cpus"),
    ("ray.num_cpus=2;rollout.agent_pool.num_cpus_per_worker=1", "ray.num_cpus", "+ agent 1 x 1"),
])
def test_agent_conflicts_name_the_field(spec_file, override, field, words):
    message = problem(spec_file, *override.split(";"))
    assert field in message and words in message, message


def test_agent_settings_without_an_agent_are_refused(spec_file):
    message = problem(spec_file, "rollout.agent=null")
    assert "rollout.agent_options" in message and "has no effect unless rollout.agent" in message
    message = problem(spec_file, "rollout.agent=null", "rollout.agent_options={}", "rollout.agent_pool.workers=2")
    assert "rollout.agent_pool" in message and "multi_turn.runner: agent_pool" in message
    message = problem(spec_file, "rollout.agent=null", "rollout.agent_options={}", "algorithm.rewards={}")
    assert "algorithm.rewards" in message and "expected at least one reward" in message  # {} only with an agent


def test_agent_eval_is_scored_by_its_own_reward(spec_file, tmp_path):
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    spec = load_spec(spec_file, [f"eval={{data_path: {held}}}"])
    assert spec.eval.format_reward is None
    message = problem(spec_file, f"eval={{data_path: {held}, accuracy_reward: accuracy}}")
    assert "eval.accuracy_reward" in message and "scored by its own reward" in message


def test_multi_turn_runner_agent_pool_puts_the_environment_on_the_agent_pool(spec_file):
    spec = load_spec(spec_file, ["rollout.agent=null", "rollout.agent_options={}", "algorithm.rewards={format: 1.0}",
                                 "rollout.multi_turn={environment: scripted, max_turns: 2, max_episode_tokens: 300, "
                                 "runner: agent_pool}", "rollout.agent_pool.workers=2"])
    assert spec.rollout.multi_turn.runner == "agent_pool" and spec.rollout.agent_pool.workers == 2
    message = problem(spec_file, "rollout.agent=null", "rollout.agent_options={}", "algorithm.rewards={format: 1.0}",
                      "rollout.multi_turn={environment: scripted, max_turns: 2, max_episode_tokens: 300, "
                      "runner: agent_pool, parallel: 8}")
    assert "rollout.multi_turn.parallel" in message and "runner: lock_step" in message
    message = problem(spec_file, "rollout.agent=null", "rollout.agent_options={}", "algorithm.rewards={format: 1.0}",
                      "rollout.multi_turn={environment: scripted, max_turns: 2, max_episode_tokens: 300, "
                      "runner: agent_pool}", "rollout.agent_pool.max_episode_tokens=100")
    assert "rollout.agent_pool.max_episode_tokens" in message and "rollout.multi_turn.max_episode_tokens" in message


def test_validate_prints_the_agent_and_refuses_a_broken_one_before_anything_starts(spec_file, tiny_model_dir,
                                                                                    capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    tiny = ["--set", f"model.path={tiny_model_dir}", "--set", "metrics.port=null"]
    assert main(["validate", str(spec_file), *tiny]) == 2  # the default 4096-token episodes: beyond its 2048
    assert "rollout.agent_pool.max_episode_tokens" in capsys.readouterr().err
    assert main(["validate", str(spec_file), *tiny, "--set", "rollout.agent_pool.max_episode_tokens=1024"]) == 0
    out = capsys.readouterr().out
    assert f"agent.py:run with {{'max_turns': 3}} ({spec_file.parent / 'agent.py'}:4)" in out
    assert "1 worker(s) x 16 episodes at once, 0 CPU each" in out
    assert main(["validate", str(spec_file), "--set", f"model.path={tiny_model_dir}", "--set",
                 "rollout.agent=broken.py:run"]) == 2
    err = capsys.readouterr().err
    assert "--set rollout.agent: agent 'broken.py:run'" in err and "broken.py:3: cannot import" in err
    assert "NameError: name 'undefined_name' is not defined" in err and "Traceback" not in err
    assert not (spec_file.parent / "out").exists()


def test_submit_ships_the_agent_file(spec_file, tmp_path):
    from cluster.ops.reward_files import reward_files

    spec = load_spec(spec_file)
    root = tmp_path / "upload"
    root.mkdir()
    files = reward_files(spec, spec_file.parent, root)
    assert files == {"agent.py": textwrap.dedent(AGENT)}


async def episode(client, row, max_turns=2):
    return 1.0


def plain_episode(client, row):
    return 1.0


async def lone_episode(client):
    return 1.0


@pytest.mark.parametrize("fn, options, said", [
    (episode, {"turns": 1}, "cannot be called as episode(client, row, **{'turns': 1})"),
    (plain_episode, {}, "plain_episode is a plain function (def)"),
    (lone_episode, {}, "lone_episode(client) takes 1 positional parameter(s)"),
])
def test_agent_signature_problem_names_the_users_function_not_run(fn, options, said):
    """The user's agent is called ``episode`` (or anything else): the message shows the contract with that name."""
    from cluster.agents.loading import check_agent_signature

    problem = check_agent_signature(fn, f"agent.py:{fn.__name__}", options)
    assert said in problem.message, problem.message
    assert f"expected async def {fn.__name__}(client, row, **options)" in problem.message, problem.message
    assert "run(" not in problem.message, problem.message
