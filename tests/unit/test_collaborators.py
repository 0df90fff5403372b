"""A part's collaborators are given when it is built, never set on it from outside afterwards (STYLE 15).

- ``GRPOJob`` hands its fleet, trainer and multi-turn episode runner to the parts that call them (the batch producer,
  the train phase) when it builds them, so a built job — started or not, dry run or not — has one fleet and one
  trainer everywhere, and the step's clock is the train phase's own (:meth:`TrainPhase.begin_step`).
- No module of the project's packages assigns an attribute of one of its attributes (``self.producer.fleet = ...``,
  ``self.sender.source = ...``): the object owning that attribute takes it at construction or through a method of its
  own. (An augmented assignment to an attribute of one's own record, ``self.figures.stale_refused += n``, counts
  into it and is not a collaborator's wiring.)
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
from pathlib import Path

import pytest

from cluster.driver import GRPOJob
from cluster.spec import load_spec_text
from tests.stand_ins import StandInFleet, StandInTrainer

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("contract", "grpo", "cluster", "rollout_workers", "train_workers", "weight_sync")
#: (file, statement) that set an attribute of an attribute and are not wiring, with why.
NOT_WIRING = {
    ("train_workers/megatron/config.py", "self.weight.sequence_parallel = bool(config.sequence_parallel)"):
        "megatron-core's convention: a flag on the parameter tensor (its gradient is all-reduced over the TP group)",
    ("cluster/endpoint/server.py", "self._uvicorn.should_exit = True"):
        "uvicorn's way to stop a Server run programmatically (its serve loop polls should_exit; handle_exit would "
        "also record a signal it re-raises when serving on the main thread)",
}


def _spec(tmp_path: Path, model: str, rollout: str = "prompts_per_step: 2, group_size: 2"):
    rows = "".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n" for i in range(4))
    (tmp_path / "train.jsonl").write_text(rows)
    return load_spec_text(
        f"name: wired\noutput_dir: {tmp_path / 'out'}\ntotal_steps: 2\nmodel: {{path: {model}}}\n"
        f"data: {{train_path: {tmp_path / 'train.jsonl'}}}\nrollout: {{{rollout}}}\nmetrics: {{port: null}}\n")


@pytest.mark.parametrize("dry_run", [False, True], ids=["job", "dry_run"])
def test_the_jobs_parts_get_its_collaborators_at_construction(tmp_path, tiny_model_dir, dry_run):
    fleet, trainer = StandInFleet(), StandInTrainer()
    with contextlib.redirect_stderr(io.StringIO()):
        job = GRPOJob(_spec(tmp_path, tiny_model_dir), fleet=fleet, trainer=trainer, progress=False, dry_run=dry_run)
    try:
        assert not job.started
        assert job.producer.fleet is fleet and job.training.fleet is fleet and job.training.trainer is trainer
        assert job.producer.episodes is job.episodes is None  # single-turn
        if dry_run:
            return
        with contextlib.redirect_stderr(io.StringIO()):
            job.run()
        assert job.producer.fleet is fleet and job.training.trainer is trainer  # the same objects after the run
        clock = job.training.clock
        assert job.training.begin_step() is job.training.clock is not clock  # a new clock per step, its own
    finally:
        job.close()


def test_a_multi_turn_jobs_producer_gets_the_episode_runner_at_construction(tmp_path, tiny_model_dir):
    multi_turn = "{environment: tools, options: {tools: [calculator]}, max_turns: 2, max_episode_tokens: 64}"
    spec = _spec(tmp_path, tiny_model_dir, f"prompts_per_step: 2, group_size: 2, max_response_tokens: 16, "
                 f"multi_turn: {multi_turn}")
    with contextlib.redirect_stderr(io.StringIO()):
        job = GRPOJob(spec, fleet=StandInFleet(), trainer=StandInTrainer(), progress=False, dry_run=True)
    try:
        assert job.episodes is not None and job.producer.episodes is job.episodes
    finally:
        job.shutdown()


def wiring_after_construction(rel: str, source: str) -> list[str]:
    """``file:line: statement`` for every ``self.<a>.<b> = ...`` (plain or annotated assignment, tuple targets
    unpacked) in ``source``, but those :data:`NOT_WIRING` lists."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        for target in flat:
            holder = target.value if isinstance(target, ast.Attribute) else None
            on_self = isinstance(holder, ast.Attribute) and isinstance(holder.value, ast.Name)
            if on_self and holder.value.id == "self" and (rel, ast.unparse(node)) not in NOT_WIRING:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_no_part_sets_an_attribute_of_its_collaborator():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += wiring_after_construction(rel, path.read_text(encoding="utf-8"))
    assert not found, ("attributes set on a collaborator from outside (give them at its construction, or add a "
                       "method of its own):\n" + "\n".join(found))


@pytest.mark.parametrize("source", [
    "self.producer.fleet = self.training.fleet = self.fleet",
    "self.training.trainer = trainer",
    "clock = self.training.clock = StepClock(bar)",
    "self.sender.source: object = FSDPSyncSource()",
    "self.a.b, x = 1, 2",
])
def test_the_wiring_check_finds_each_form(source):
    assert wiring_after_construction("x.py", source)


@pytest.mark.parametrize("source", [
    "self.fleet = fleet", "self.figures.stale_refused += 3", "job.fleet = other", "state.text = decode(ids)",
])
def test_the_wiring_check_leaves_own_attributes_and_counts(source):
    assert wiring_after_construction("x.py", source) == []
