"""Held-out evaluation inside the loop (``cluster.loop.evaluation``) with a fake fleet: scores, the Wilson interval
against a hand computation, ``eval/n``, when evaluations are due, the best step, and ``checkpoint.keep_best``
pruning (``cluster.loop.checkpoint_state.prune_checkpoints``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cluster.data import DataError, Example
from cluster.loop.checkpoint_state import prune_checkpoints
from cluster.loop.checkpoints import TRAINER_STATE
from cluster.loop.evaluation import EvalSet, HeldOutEval, eval_seed, load_eval_set, restore_best, score_eval
from contract.messages import GroupRequest, GroupResult, SamplingOverride
from cluster.spec import load_spec_text
from cluster.spec.evaluation import EvalSpec
from grpo.stats import wilson_interval

WORKED = "Tom has 3 apples and buys 5 more, so 3 + 5 = 8 apples in all.\n#### {}"  # pays the format reward


def wilson_by_hand(s: float, n: int) -> tuple[float, float]:
    """The 95 % Wilson score interval written out (z = 1.959963984540054)."""
    z = 1.959963984540054
    p = s / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def result(request: GroupRequest, texts: list[str], lengths: list[int], reasons: list[str]) -> GroupResult:
    return GroupResult(request.group_id, request.prompt_ids, [[7] * n for n in lengths],
                       [torch.zeros(n) for n in lengths], reasons, texts, policy_version=0)


class FakeFleet:
    """Answers each held-out prompt from a table: prompt index -> k (text, length, finish reason)."""

    def __init__(self, answers: dict[int, list[tuple[str, int, str]]]):
        self.answers, self.calls = answers, []

    def generate(self, requests: list[GroupRequest]) -> list[GroupResult]:
        self.calls.append(requests)
        return [result(q, *map(list, zip(*self.answers[q.group_id]))) for q in requests]


def make_eval(n: int, ev: EvalSpec | None = None, total_steps: int = 10, keep_best: bool = False) -> HeldOutEval:
    examples = [Example(index=i, question=f"q{i}", answer=f"#### {i}", reference=str(i)) for i in range(n)]
    evalset = EvalSet(path="held.jsonl", field="eval.data_path", examples=examples,
                      prompt_ids=[[1, 2, i] for i in range(n)], bad_rows=0, filtered=0)
    return HeldOutEval(ev or EvalSpec(), evalset, seed=3, total_steps=total_steps, max_tokens=32,
                       keep_best=keep_best)


def test_pass_at_1_scores_and_wilson_interval_by_hand():
    evaluation = make_eval(5)
    # prompts 0, 1: correct and worked; 2: correct, bare answer line (no format); 3: wrong; 4: cut at the cap
    fleet = FakeFleet({0: [(WORKED.format(0), 10, "stop")], 1: [(WORKED.format(1), 12, "stop")],
                       2: [("#### 2", 4, "stop")], 3: [(WORKED.format(99), 14, "stop")],
                       4: [("Let me think about", 32, "length")]})
    m = evaluation.run(0, fleet.generate)
    low, high = wilson_by_hand(3, 5)
    assert m["eval/accuracy"] == pytest.approx(3 / 5)
    assert (m["eval/accuracy_ci_low"], m["eval/accuracy_ci_high"]) == pytest.approx((low, high))
    assert (round(low, 4), round(high, 4)) == (0.2307, 0.8824)  # Wilson (1927) for 3 of 5, from a table
    assert m["eval/n"] == 5.0 and m["eval/problems"] == 5.0
    assert m["eval/response_length_mean"] == pytest.approx((10 + 12 + 4 + 14 + 32) / 5)
    assert m["eval/truncated_fraction"] == pytest.approx(1 / 5)
    assert m["eval/format_rate"] == pytest.approx(3 / 5)
    assert m["eval/seconds"] >= 0 and (m["eval/best_accuracy"], m["eval/best_step"]) == (pytest.approx(0.6), 0.0)
    # greedy requests: one completion each, the eval's cap, a fixed seed per prompt (the same at every evaluation)
    requests = fleet.calls[0]
    assert [q.group_size for q in requests] == [1] * 5
    assert {q.sampling for q in requests} == {SamplingOverride(temperature=0.0, max_tokens=32)}
    assert [q.seed for q in requests] == [eval_seed(3, i) for i in range(5)]
    evaluation.run(1, fleet.generate)
    assert [q.seed for q in fleet.calls[1]] == [q.seed for q in requests]


def test_mean_at_k_counts_every_sample_in_n_and_the_interval_over_problems():
    evaluation = make_eval(2, EvalSpec(samples=4, temperature=1.0, format_reward=None))
    right, wrong = (WORKED.format(0), 5, "stop"), ("no idea", 5, "stop")
    fleet = FakeFleet({0: [right, right, right, wrong], 1: [(WORKED.format(1), 5, "stop"), wrong, wrong, wrong]})
    m = evaluation.run(0, fleet.generate)
    assert m["eval/accuracy"] == pytest.approx((3 / 4 + 1 / 4) / 2)
    assert m["eval/n"] == 8.0 and m["eval/problems"] == 2.0
    assert (m["eval/accuracy_ci_low"], m["eval/accuracy_ci_high"]) == pytest.approx(wilson_by_hand(1.0, 2))
    assert "eval/format_rate" not in m
    assert {q.group_size for q in fleet.calls[0]} == {4}


@pytest.fixture
def test_rewards():
    """Registers ``eval_test_unscored`` (None, NaN, then 1.0) and ``eval_test_two`` (2.0 each) for one test."""
    from grpo.rewards import REWARD_FUNCTIONS, register_reward_function

    register_reward_function("eval_test_unscored")(lambda c, r: [{"x": None, "y": float("nan")}.get(t, 1.0) for t in c])
    register_reward_function("eval_test_two")(lambda c, r: [2.0] * len(c))
    register_reward_function("eval_test_partial")(lambda c, r: [0.75, 0.999, 1.0, 0.0][:len(c)])
    yield
    REWARD_FUNCTIONS.pop("eval_test_unscored")
    REWARD_FUNCTIONS.pop("eval_test_two")
    REWARD_FUNCTIONS.pop("eval_test_partial")


def test_partial_credit_is_a_wrong_answer_in_pass_at_1(test_rewards):
    """A scorer's partial point (reasoning-gym pays 0.75 for '-191' against 191) is not a pass: pass@1 counts full
    scores only, so the Wilson interval is over 0/1 outcomes."""
    groups = [result(GroupRequest(0, [1], group_size=4), ["a", "b", "c", "d"], [1] * 4, ["stop"] * 4)]
    m = score_eval(groups, ["1"], "eval_test_partial", None)
    assert m["eval/accuracy"] == pytest.approx(1 / 4) and m["eval/n"] == 4.0


def test_denominator_an_unscored_completion_is_left_out_of_the_accuracy_and_counted(test_rewards):
    """Issue 35: a completion the accuracy reward gave no score (None, NaN: its verifier failed) is not a wrong
    answer: it leaves eval/accuracy, its Wilson interval, eval/n and eval/problems, and is counted in eval/unscored
    (the training side's "None: no score, not a wrong answer"). Scores outside [0, 1] are still refused."""
    groups = [result(GroupRequest(i, [1]), [text], [1], ["stop"]) for i, text in enumerate(["x", "y", "z"])]
    m = score_eval(groups, ["1", "2", "3"], "eval_test_unscored", None)
    assert (m["eval/accuracy"], m["eval/n"], m["eval/problems"], m["eval/unscored"]) == (1.0, 1.0, 1.0, 2.0)
    assert (m["eval/accuracy_ci_low"], m["eval/accuracy_ci_high"]) == pytest.approx(wilson_interval(1, 1))
    k2 = [result(GroupRequest(0, [1], group_size=2), ["x", "z"], [1, 1], ["stop"] * 2),
          result(GroupRequest(1, [1], group_size=2), ["a", "b"], [1, 1], ["stop"] * 2),
          result(GroupRequest(2, [1], group_size=2), ["x", "y"], [1, 1], ["stop"] * 2)]
    m = score_eval(k2, ["1", "2", "3"], "eval_test_unscored", None)  # problem 2 has no scored completion
    assert (m["eval/accuracy"], m["eval/n"], m["eval/problems"], m["eval/unscored"]) == (1.0, 3.0, 2.0, 3.0)
    assert (m["eval/accuracy_ci_low"], m["eval/accuracy_ci_high"]) == pytest.approx(wilson_interval(2, 2))
    nothing = score_eval(groups[:2], ["1", "2"], "eval_test_unscored", None)
    assert math.isnan(nothing["eval/accuracy"]) and (nothing["eval/n"], nothing["eval/unscored"]) == (0.0, 2.0)
    with pytest.raises(ValueError, match="reward function 'eval_test_two' gave 2.0; eval needs scores in \\[0, 1\\]"):
        score_eval(groups, ["1", "2", "3"], "eval_test_two", None)


@pytest.mark.parametrize(("ev", "due"), [
    (EvalSpec(), [0, 10]),
    (EvalSpec(every_steps=3), [0, 3, 6, 9, 10]),
    (EvalSpec(every_steps=5, at_start=False, at_end=False), [5, 10]),
    (EvalSpec(at_start=False), [10]),
])
def test_due_steps(ev, due):
    evaluation = make_eval(1, ev, total_steps=10)
    assert [s for s in range(0, 11) if evaluation.due(s)] == due


def test_best_step_ties_keep_the_earlier_and_keep_best_asks_for_checkpoints(tmp_path):
    evaluation = make_eval(4, EvalSpec(every_steps=1), keep_best=True)
    right, wrong = WORKED.format, ("wrong", 3, "stop")
    correct = {0: 1, 1: 2, 2: 2, 3: 3, 4: 1}  # step -> prompts answered correctly (0..c-1)
    rows = {}
    for step, c in correct.items():
        fleet = FakeFleet({i: [(right(i), 3, "stop")] if i < c else [wrong] for i in range(4)})
        rows[step] = evaluation.run(step, fleet.generate)
        assert evaluation.checkpoint_wanted(step) == (step in (1, 3))  # new bests after step >= 1
    assert [rows[s]["eval/best_step"] for s in range(5)] == [0.0, 1.0, 1.0, 3.0, 3.0]  # step 2 ties step 1
    assert rows[4]["eval/best_accuracy"] == pytest.approx(3 / 4) and evaluation.protected_step() == 3
    # the best is part of the checkpoint state, and comes back on resume
    ckpt = tmp_path / "step_000004"
    ckpt.mkdir()
    (ckpt / TRAINER_STATE).write_text(json.dumps({"step": 4, "eval": evaluation.state_dict()}))
    resumed = make_eval(4, EvalSpec(every_steps=1), keep_best=True)
    restore_best(resumed, ckpt)
    assert (resumed.best_step, resumed.best_accuracy) == (3, pytest.approx(0.75))
    (ckpt / TRAINER_STATE).write_text(json.dumps({"step": 4}))  # a checkpoint of a job without eval
    restore_best(resumed, ckpt)
    assert resumed.best_step is None and resumed.protected_step() is None


def test_without_keep_best_and_at_step_0_nothing_is_protected():
    evaluation = make_eval(1)
    evaluation.run(0, FakeFleet({0: [(WORKED.format(0), 3, "stop")]}).generate)
    assert not evaluation.checkpoint_wanted(0) and evaluation.protected_step() is None
    kept = make_eval(1, keep_best=True)
    kept.run(0, FakeFleet({0: [(WORKED.format(0), 3, "stop")]}).generate)
    assert not kept.checkpoint_wanted(0) and kept.protected_step() is None  # the best is the starting model


def _checkpoints(root: Path, steps: list[int]) -> None:
    for step in steps:
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / TRAINER_STATE).write_text("{}")


def test_keep_last_spares_the_protected_best_checkpoint(tmp_path):
    _checkpoints(tmp_path, [2, 4, 6, 8])
    prune_checkpoints(tmp_path, keep_last=2, protect=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000006", "step_000008"]
    prune_checkpoints(tmp_path, keep_last=2, protect=8)  # the best among the newest: no extra one kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000006", "step_000008"]
    prune_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000008"]


class CharTokenizer:
    """A chat template that is one token per character of the user message (enough for prompt-length checks)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kwargs):
        return [ord(c) % 97 for c in messages[-1]["content"]]


def _spec(tmp_path: Path, extra: str):
    return load_spec_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: 2\n"
                          f"data: {{train_path: {tmp_path / 'train.jsonl'}, max_prompt_tokens: 12}}\n{extra}")


def test_load_eval_set_limits_filters_and_names_the_field(tmp_path, monkeypatch):
    import cluster.loop.evaluation as evaluation

    monkeypatch.setattr(evaluation, "prompt_ids",
                        lambda data, tok, examples, what: [[0] * len(e.question) for e in examples])
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"question": q, "answer": f"#### {i}"}) + "\n"
                            for i, q in enumerate(["short", "a question that is too long", "tiny", "mid one"])))
    spec = _spec(tmp_path, f"eval: {{data_path: {held}, limit: 2}}\n")
    evalset = load_eval_set(spec.eval, spec.data, CharTokenizer())
    assert [e.question for e in evalset.examples] == ["short", "tiny"] and evalset.filtered == 1
    assert evalset.field == "eval.data_path" and evalset.prompt_ids == [[0] * 5, [0] * 4]
    missing = _spec(tmp_path, f"eval: {{data_path: {tmp_path / 'nope.jsonl'}}}\n")
    with pytest.raises(DataError, match="^eval.data_path: data file .*nope.jsonl not found"):
        load_eval_set(missing.eval, missing.data, CharTokenizer())
    (tmp_path / "bad.jsonl").write_text("not json\n")
    spec = load_spec_text(f"output_dir: o\ntotal_steps: 2\ndata: {{train_path: x, test_path: "
                          f"{tmp_path / 'bad.jsonl'}, on_bad_row: skip}}\neval: {{}}\n")
    with pytest.raises(DataError, match="^data.test_path: .*bad.jsonl: no usable rows"):
        load_eval_set(spec.eval, spec.data, CharTokenizer())
    (tmp_path / "long.jsonl").write_text(json.dumps({"question": "x" * 50, "answer": "#### 1"}) + "\n")
    spec = _spec(tmp_path, f"eval: {{data_path: {tmp_path / 'long.jsonl'}}}\n")
    with pytest.raises(DataError, match="^eval.data_path: .*all 1 prompts are longer than data.max_prompt_tokens=12"):
        load_eval_set(spec.eval, spec.data, CharTokenizer())


def test_the_monitor_reads_the_eval_rows():
    """grpo.monitor's eval_drop detector takes these rows as they are: a step-0 eval-only row, then a drop below the
    first evaluation's interval."""
    from grpo.monitor import Monitor

    evaluation = make_eval(40, EvalSpec(every_steps=1))
    monitor = Monitor()
    right, wrong = (WORKED.format, ("wrong", 3, "stop"))
    for step, c in enumerate([30, 29, 5]):
        row = evaluation.run(step, FakeFleet({i: [(right(i), 3, "stop")] if i < c else [wrong]
                                              for i in range(40)}).generate)
        out = monitor.update(step, row)
    assert out["monitor/eval_drop"] == 1.0 and monitor.first_trip.step == 2


def test_the_engine_samples_eval_requests_with_their_override_and_training_ones_with_the_spec():
    from types import SimpleNamespace

    from cluster.spec import RolloutSpec
    from rollout_workers.vllm.engine import VLLMEngine

    engine = SimpleNamespace(rollout=RolloutSpec(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                                                 max_response_tokens=64))
    train = VLLMEngine._sampling(engine, GroupRequest(0, [1], seed=5))
    assert train == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_tokens": 64}
    held = VLLMEngine._sampling(engine, GroupRequest(0, [1], seed=5, sampling=SamplingOverride(0.0, 32)))
    assert held == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 32}


def test_dropped_held_out_rows_are_an_eval_metric_and_in_the_console_line(tmp_path, monkeypatch):
    """A held-out file of 5 rows: one too long for data.max_prompt_tokens, one unreadable (skipped): the evaluation
    scores 3 and says it dropped 2 (``eval/dropped``), on its metrics row and in the console line; a file that drops
    nothing says 0."""
    import cluster.loop.evaluation as evaluation
    from cluster.sinks.metrics import format_console_line

    monkeypatch.setattr(evaluation, "prompt_ids",
                        lambda data, tok, examples, what: [[0] * len(e.question) for e in examples])
    held = tmp_path / "held.jsonl"
    rows = [json.dumps({"question": q, "answer": f"#### {i}"}) for i, q in
            enumerate(["short", "a question that is too long", "tiny", "mid one"])]
    held.write_text("\n".join([*rows, "not json"]) + "\n")
    spec = load_spec_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: 2\ndata: {{train_path: "
                          f"{tmp_path / 'train.jsonl'}, max_prompt_tokens: 12, on_bad_row: skip}}\n"
                          f"eval: {{data_path: {held}}}\n")
    evalset = load_eval_set(spec.eval, spec.data, CharTokenizer())
    assert (len(evalset.examples), evalset.filtered, evalset.bad_rows) == (3, 1, 1)
    run = HeldOutEval(spec.eval, evalset, seed=3, total_steps=2, max_tokens=32)
    answers = {i: [(WORKED.format(ex.reference), 3, "stop")] for i, ex in enumerate(evalset.examples)}
    metrics = run.run(1, FakeFleet(answers).generate)
    assert metrics["eval/dropped"] == 2.0 and metrics["eval/problems"] == 3.0
    line = format_console_line(1, metrics)
    assert "n=3 dropped 2" in line, line
    assert make_eval(2).run(0, FakeFleet({i: [(WORKED.format(i), 3, "stop")] for i in range(2)}).generate)[
        "eval/dropped"] == 0.0


def test_denominator_held_out_eval_warns_about_unscored_completions_and_never_makes_a_nan_best(test_rewards):
    """An evaluation with unscored completions says so (the job's status line: a warning naming the reward and the
    counts) and shows them on the console line; one that scored nothing reports NaN and sets no best step."""
    from cluster.sinks.metrics import format_console_line

    warnings: list[str] = []
    evaluation = make_eval(3, EvalSpec(accuracy_reward="eval_test_unscored", format_reward=None))
    evaluation.warn = warnings.append
    nothing = evaluation.run(0, FakeFleet({i: [("x", 3, "stop")] for i in range(3)}).generate)
    assert math.isnan(nothing["eval/accuracy"]) and nothing["eval/unscored"] == 3.0 and nothing["eval/n"] == 0.0
    assert evaluation.best_step is None and "eval/best_accuracy" not in nothing
    assert warnings == ["warning: step 0: eval: 3 of 3 held-out completions got no score from eval.accuracy_reward "
                        "'eval_test_unscored' (None: its verifier could not run); they are left out of eval/accuracy "
                        "and its interval, which are over the 0 scored (0 problems), and counted in eval/unscored"]
    some = evaluation.run(1, FakeFleet({0: [("x", 3, "stop")], 1: [("a", 3, "stop")], 2: [("y", 3, "stop")]}).generate)
    assert (some["eval/accuracy"], some["eval/n"], some["eval/unscored"]) == (1.0, 1.0, 2.0)
    assert some["eval/best_step"] == 1.0
    assert len(warnings) == 2 and "2 of 3 held-out completions" in warnings[1]
    assert "eval 1.000 [0.207, 1.000] n=1 unscored 2" in format_console_line(1, some)
    clean = evaluation.run(2, FakeFleet({i: [("a", 3, "stop")] for i in range(3)}).generate)
    assert len(warnings) == 2 and "unscored" not in format_console_line(2, clean)
