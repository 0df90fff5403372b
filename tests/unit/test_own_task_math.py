"""Issue #27, the ``math`` reward: LaTeX answers verified by math-verify in a worker process with its own deadline,
called from a thread that is not the main one (math-verify's signal.alarm timeouts raise there), and the worker process
itself (``sandbox.verifier_process``): a hang is a timeout, a crash is a death, both survived."""

from __future__ import annotations

import threading

import pytest

from grpo.rewards import REWARD_FUNCTIONS, combine_rewards
from sandbox import math_reward as math_reward_module, math_worker
from sandbox.math_reward import check_math_reference
from sandbox.verifier_process import Outcome, VerifierProcess

pytest.importorskip("math_verify")

# (reference as the answer column holds it, completion, score)
TABLE = [
    ("72", "48 + 24 = 72, so the answer is \\boxed{72}.", 1.0),
    ("72", "\\boxed{73}", 0.0),
    ("\\frac{1}{2}", "The answer is $\\boxed{0.5}$.", 1.0),
    ("0.5", "so \\boxed{\\frac{1}{2}}", 1.0),
    ("\\frac{3}{4}", "$\\frac{6}{8}$", 1.0),
    ("\\frac{3}{4}", "\\boxed{\\frac{4}{3}}", 0.0),
    ("[1, 3)", "\\boxed{[1,3)}", 1.0),
    ("[1, 3)", "\\boxed{(1,3)}", 0.0),
    ("[1, 3)", "\\boxed{[1,3]}", 0.0),
    ("(-\\infty, 0]", "\\boxed{(-\\infty,0]}", 1.0),
    ("\\{1, 2, 3\\}", "\\boxed{\\{3, 2, 1\\}}", 1.0),
    ("\\{1, 2\\}", "\\boxed{\\{1, 3\\}}", 0.0),
    ("\\sqrt{2}", "\\boxed{2^{1/2}}", 1.0),
    ("x^2 + 1", "\\boxed{1 + x^2}", 1.0),
    ("The answer is $\\boxed{5}$.", "\\boxed{5}", 1.0),  # a whole MATH solution as the reference
    ("12", "I do not know.", 0.0),
]


def in_a_thread(fn, *args):
    """Run ``fn`` on a thread that is not the main one; return its result (or raise its exception)."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_own_task_math_reward_table_off_the_main_thread():
    refs, completions, expected = map(list, zip(*TABLE))
    assert "math" in REWARD_FUNCTIONS
    assert in_a_thread(REWARD_FUNCTIONS["math"], completions, refs) == expected
    result = in_a_thread(lambda: combine_rewards(completions, refs, {"math": 1.0}))
    assert result.total.tolist() == expected


def test_own_task_math_reference_check():
    in_a_thread(check_math_reference, "\\frac{1}{2}")
    for bad in ("", "   "):
        with pytest.raises(ValueError, match=r"math-verify finds no answer in it \(reference "):
            check_math_reference(bad)
    assert REWARD_FUNCTIONS["math"].check_row is check_math_reference


@pytest.fixture
def quick_math(monkeypatch):
    """The math reward with a 10-second deadline per completion (room for a loaded machine); its own worker, closed
    afterwards."""
    worker = VerifierProcess(f"{math_worker.__file__}:verify_item", timeout_s=10.0)
    monkeypatch.setattr(math_reward_module, "_worker", worker)
    monkeypatch.setattr(math_reward_module, "MATH_TIMEOUT_S", 10.0)
    yield worker
    worker.close()


def test_own_task_math_verifier_hang_is_a_timeout_scored_zero(quick_math):
    """sympy does not finish 9^(9^(9^9)); the completion's own expression is at fault: 0.0, and the next completion
    is scored by a fresh worker."""
    scores = in_a_thread(math_reward_module.math_reward, ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{1}"], ["1", "1"])
    assert scores == [0.0, 1.0] and quick_math.restarts == 1


WORKER = '''
import os, time

def serve(item):
    kind, value = item
    if kind == "sleep":
        time.sleep(value)
    if kind == "die":
        os._exit(3)
    if kind == "raise":
        raise ValueError(value)
    if kind == "print":
        print("noise on stdout")
    return value
'''


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker_fn.py"
    path.write_text(WORKER)
    proc = VerifierProcess(f"{path}:serve", timeout_s=2.0)
    yield proc
    proc.close()


def test_own_task_verifier_process_outcomes(worker):
    items = [("ok", 1), ("sleep", 30), ("ok", 2), ("die", 0), ("raise", "bad input"), ("print", 3), ("ok", 4)]
    outcomes = in_a_thread(worker.map, items)
    assert outcomes == [Outcome("ok", 1), Outcome("timeout"), Outcome("ok", 2), Outcome("died"),
                        Outcome("error", "ValueError: bad input"), Outcome("ok", 3), Outcome("ok", 4)]
    assert worker.restarts == 2


def test_own_task_math_worker_death_is_no_score(monkeypatch, tmp_path):
    path = tmp_path / "dies.py"
    # the item is ("verify", reference, [(statement, offers_alternatives), ...]): here [("\\boxed{crash}", False)]
    path.write_text("import os\n\ndef verify_item(item):\n    os._exit(1) if 'crash' in item[2][0][0] else None\n"
                    "    return 1.0\n")
    worker = VerifierProcess(f"{path}:verify_item", timeout_s=15.0)
    monkeypatch.setattr(math_reward_module, "_worker", worker)
    try:
        completions = ["\\boxed{fine}", "\\boxed{crash}", "\\boxed{fine}"]
        assert math_reward_module.math_reward(completions, ["1", "1", "1"]) == [1.0, None, 1.0]
    finally:
        worker.close()
