"""Issue #27, a self-contained spec on a cluster: ``grpo-cluster submit`` ships the reward files the spec names
(``cluster.ops.reward_files``) into the uploaded working dir, where the submitted spec finds them; what cannot be
placed there is refused naming the field. No Ray: the staged working dir is checked as the job would read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.ops.jobs import SPEC_FILE, JobsError, stage_working_dir
from cluster.ops.reward_files import reward_files
from cluster.spec import load_spec, spec_to_yaml

REWARD = "def score(completions, level):\n    return [float(x) for x in level]\n"


def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    return root


def user_spec(tmp_path: Path, rewards: str) -> Path:
    task = tmp_path / "task"
    task.mkdir(exist_ok=True)
    (task / "train.jsonl").write_text(json.dumps({"prompt": "Q?", "level": 1}) + "\n")
    path = task / "spec.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: 1\ndata:\n  train_path: train.jsonl\n"
                    f"  prompt_field: prompt\nalgorithm:\n  rewards:\n{rewards}")
    return path


def test_own_task_submit_ships_a_reward_file_from_outside_the_working_dir(tmp_path):
    root = project(tmp_path)
    path = user_spec(tmp_path, '    "rewards/mine.py:score": 1.0\n')
    (path.parent / "rewards").mkdir()
    (path.parent / "rewards" / "mine.py").write_text(REWARD)
    spec = load_spec(path)
    files = reward_files(spec, path.parent, root)
    assert files == {"rewards/mine.py": REWARD}
    staged = stage_working_dir(root, tmp_path / "staged", {**files, SPEC_FILE: spec_to_yaml(spec)})
    again = load_spec(staged / SPEC_FILE)  # as `cluster.cli run grpo_job_spec.yaml` reads it on the cluster
    from grpo.rewards import REWARD_FUNCTIONS
    from grpo.rewards.calling import where_defined

    assert where_defined(REWARD_FUNCTIONS["rewards/mine.py:score"]).startswith(str(staged / "rewards" / "mine.py"))
    assert again.algorithm.rewards == spec.algorithm.rewards


def test_own_task_submit_ships_a_module_from_the_spec_folder_not_an_installed_one(tmp_path):
    root = project(tmp_path)
    path = user_spec(tmp_path, '    "own_task_submit_mod:score": 1.0\n    "pkg:fn": 0.0\n')
    (path.parent / "own_task_submit_mod.py").write_text(REWARD)
    (root / "pkg" / "__init__.py").write_text("def fn(completions):\n    return [0.0] * len(completions)\n")
    import sys

    sys.path.append(str(root))  # the working dir's own package: importable here, uploaded with it
    try:
        spec = load_spec(path)
        assert reward_files(spec, path.parent, root) == {"own_task_submit_mod.py": REWARD}
    finally:
        sys.path.remove(str(root))


def test_own_task_submit_sends_nothing_for_a_file_already_in_place(tmp_path):
    root = project(tmp_path)
    spec_dir = root / "examples"
    spec_dir.mkdir()
    (spec_dir / "r.py").write_text(REWARD)
    (root / "r.py").write_text(REWARD)  # where the submitted spec (at the root) looks for it: the same text
    (spec_dir / "train.jsonl").write_text(json.dumps({"prompt": "Q?", "level": 1}) + "\n")
    (spec_dir / "spec.yaml").write_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: 1\ndata:\n  train_path: "
                                        f"train.jsonl\n  prompt_field: prompt\nalgorithm:\n  rewards: "
                                        f"{{r.py:score: 1}}\n")
    spec = load_spec(spec_dir / "spec.yaml")
    assert reward_files(spec, spec_dir, root) == {}
    (root / "r.py").write_text("# another file\n" + REWARD)
    with pytest.raises(JobsError, match=r"algorithm.rewards: reward 'r.py:score': the uploaded working dir .* already "
                                        r"has a different r.py"):
        reward_files(spec, spec_dir, root)


def test_own_task_submit_refuses_a_reward_file_outside_the_spec_folder(tmp_path):
    root = project(tmp_path)
    (tmp_path / "shared.py").write_text(REWARD)
    path = user_spec(tmp_path, '    "../shared.py:score": 1.0\n')
    spec = load_spec(path)  # valid here: the file exists
    with pytest.raises(JobsError, match=r"algorithm.rewards: reward '../shared.py:score' names .*shared.py, outside "
                                        r"the spec file's folder; submit ships reward files"):
        reward_files(spec, path.parent, root)
