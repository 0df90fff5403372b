"""The driver's wiring of held-out evaluation, over stand-in collaborators (``tests/stand_ins.py``). Checks the
step-0 row, eval keys merged into the due steps' rows, a checkpoint written for a new best (``keep_best``), the
pruning that spares it, the best restored on resume, and that a job without an eval section logs no eval key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.driver import GRPOJob
from cluster.loop.checkpoints import TRAINER_STATE
from cluster.spec import load_spec_text
from contract.messages import GroupResult
from tests.stand_ins import StandInFleet, StandInTrainer

WORKED = "Tom has 3 apples and buys 5 more, so 3 + 5 = 8 apples in all.\n#### {}"


class FakeFleet(StandInFleet):
    """Answers held-out prompt i correctly when i < the number ``correct`` holds for the current evaluation
    (held-out requests carry a sampling override); training groups as the stand-in's."""

    def __init__(self, correct: list[int]):
        super().__init__()
        self.correct, self.evals, self.record = correct, 0, []

    def generate(self, requests, on_groups=None, record=True, recover=True, interrupt_epoch=None):
        if requests[0].sampling is None:
            return super().generate(requests, on_groups, record, recover, interrupt_epoch)
        self.record.append(record)
        c = self.correct[self.evals]
        self.evals += 1
        return [GroupResult(q.group_id, q.prompt_ids, [[5] * 4], [None], ["stop"],
                            [WORKED.format(2 * q.group_id if q.group_id < c else -1)], 0) for q in requests]


class SavingTrainer(StandInTrainer):
    """Records the step of every checkpoint written."""

    def __init__(self):
        super().__init__()
        self.saved: list[int] = []

    def save_checkpoint(self, folder: str, checkpoint: str | None = None) -> None:
        super().save_checkpoint(folder, checkpoint)
        self.saved.append(int(Path(checkpoint).name[len("step_"):]))


def _job(tmp_path: Path, model: str, extra: str, steps: int = 4):
    """A spec with 4 prompts (also the held-out set: prompt i's answer is 2i), metrics without Prometheus."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                             for i in range(4)))
    return load_spec_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: {steps}\nmodel: {{path: {model}}}\n"
                          f"data: {{train_path: {train}, test_path: {train}}}\nmetrics: {{port: null}}\n{extra}")


def _run(spec, correct, resume=False):
    trainer = SavingTrainer()
    job = GRPOJob(spec, fleet=FakeFleet(correct), trainer=trainer, progress=False, resume=resume)
    try:
        history = job.run()
    finally:
        job.close()
    rows = [json.loads(line) for line in (Path(spec.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return job, history, rows, trainer.saved


def test_eval_rows_new_best_checkpoints_and_keep_best_pruning(tmp_path, tiny_model_dir):
    # evaluations at steps 0, 2, 4 (every 2, at_end) with 1, 3, 2 of 4 prompts correct: best at step 2
    spec = _job(tmp_path, tiny_model_dir, "eval: {every_steps: 2}\n"
                "checkpoint: {every_steps: 3, keep_last: 1, keep_best: true}\n")
    job, history, rows, saved = _run(spec, [1, 3, 2])
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r.get("eval/accuracy") for r in rows] == [0.25, None, 0.75, None, 0.5]
    assert "policy_version" not in rows[0] and rows[2]["policy_version"] == 2
    assert [r["eval/best_step"] for r in rows if "eval/n" in r] == [0, 2, 2]
    assert rows[0]["eval/n"] == 4 and "eval/format_rate" in rows[0]
    assert all(not rec for rec in job.fleet.record)  # eval calls never add to the step's engine figures
    assert [m.get("eval/accuracy") for m in history] == [None, 0.75, None, 0.5]
    assert saved == [2, 3, 4]  # 2: the new best (not due by every_steps); 3: every_steps; 4: save_final
    ckpts = Path(spec.output_dir) / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002", "step_000004"]  # keep_last 1 + the best
    assert json.loads((ckpts / "step_000004" / TRAINER_STATE).read_text())["eval"] == {
        "best_step": 2, "best_accuracy": 0.75}


def test_resume_keeps_the_best_and_does_not_repeat_the_start_eval(tmp_path, tiny_model_dir):
    spec = _job(tmp_path, tiny_model_dir, "eval: {every_steps: 1}\ncheckpoint: {every_steps: 1, keep_best: true}\n",
                steps=2)
    _run(spec, [2, 3, 1])  # steps 0, 1, 2: best at step 1
    longer = spec.model_copy(update={"total_steps": 3})
    job, history, rows, saved = _run(longer, [1], resume=True)
    assert job.fleet.evals == 1 and [m["eval/best_step"] for m in history] == [1]  # only step 3 evaluated
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


def test_no_eval_section_no_eval_keys(tmp_path, tiny_model_dir):
    spec = _job(tmp_path, tiny_model_dir, "", steps=2)
    job, history, rows, saved = _run(spec, [])
    assert job.evaluation is None and [r["step"] for r in rows] == [1, 2]
    assert not any(k.startswith("eval/") for r in rows for k in r)
    assert "eval" not in json.loads((Path(spec.output_dir) / "checkpoints" / "step_000002" / TRAINER_STATE)
                                    .read_text())


@pytest.mark.parametrize("keep_best", [False, True])
def test_best_at_step_0_protects_nothing(tmp_path, tiny_model_dir, keep_best):
    spec = _job(tmp_path, tiny_model_dir, f"eval: {{every_steps: 1}}\ncheckpoint: {{every_steps: 1, keep_last: 1, "
                f"keep_best: {str(keep_best).lower()}}}\n", steps=3)
    job, history, rows, saved = _run(spec, [3, 1, 2, 0])
    assert saved == [1, 2, 3] and [r["eval/best_step"] for r in rows] == [0, 0, 0, 0]
    assert sorted(p.name for p in (Path(spec.output_dir) / "checkpoints").glob("step_*")) == ["step_000003"]
