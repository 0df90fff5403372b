"""GSM8K answer checker vs HF ``math-verify``: agreement with the right value, time per call, thread safety.

    PYTHONPATH=$PWD python -m bench.bench_answer_checker [--ray]

Compares :func:`grpo.rewards.gsm8k.accuracy_reward` ("ours") with ``math_verify.verify(parse(reference),
parse(completion))`` (defaults: LaTeX + expression extraction, ``parsing_timeout=5``, ``timeout_seconds=5``) on

1. the cases of issue #12 (mixed numbers, a sign before a currency sign) and the accuracy table of
   ``tests/unit/test_rewards_gsm8k.py`` (each with its right value); the hedges of issue #35 (a right value put
   forward with a wrong one: right value 0) and committed answers beside them (right value 1), one or two members of
   each kind of ``tests/unit/test_rewards_hack_hedges.py``;
2. big and pathological inputs (1 MB of digits, of "1 ", of "\\boxed{", nested braces): seconds per call;
3. one call from a non-main thread, where a Ray actor with ``max_concurrency > 1``, an async actor or a thread pool
   would run it (math-verify's timeouts use ``signal.alarm``, which works only on the main thread); with ``--ray``
   also inside a plain and a threaded Ray actor (starts a local Ray cluster: run it under the heavy-run lock).

Prints one markdown table per part. Needs ``pip install math-verify==0.9.0`` (it pulls ``latex2sympy2-extended``,
``sympy``, ``antlr4-python3-runtime``); not a project dependency, since the project does not use it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from grpo.rewards.gsm8k import accuracy_reward

GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"

NATALIA = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
           "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")

# (completion, reference, right value)
CASES: list[tuple[str, str, float]] = [
    ("It takes 2 1/2 hours.\n#### 2 1/2", "#### 2", 0.0),
    ("It takes 2 1/2 hours.\n#### 2 1/2", "2.5", 1.0),
    ("\\boxed{2\\frac{1}{2}}", "2.5", 1.0),
    ("\\boxed{2\\frac{1}{2}}", "21/2", 0.0),
    ("#### -$5", "5", 0.0),
    ("#### -$5", "-5", 1.0),
    ("#### \u2212$5", "5", 0.0),
    ("#### \u2212$5", "-5", 1.0),
    ("#### -\\$5", "5", 0.0),
    ("#### -\\$5", "-5", 1.0),
    ("Natalia sold 24 in May, so 72 in total.\n#### 72", NATALIA, 1.0),
    ("#### 71", NATALIA, 0.0),
    ("The answer is 1,234.", "1234", 1.0),
    ("#### $1,000", "1000", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("#### 18 dollars", "18", 1.0),
    ("#### 18.00", "18", 1.0),
    ("#### 5\n\nSome trailing text 7", "5", 1.0),
    ("#### 5\n\nSome trailing text 7", "7", 0.0),
    ("#### -3", "-3", 1.0),
    ("#### 3", "-3", 0.0),
    ("#### 3\n#### 4", "4", 0.0),  # two final answers: a hedge (issue #35), whichever is right
    ("#### 3\n#### 4", "3", 0.0),
    ("I don't know.", "5", 0.0),
    ("#### 0.3333333", "1/3", 1.0),
    ("#### 0.33", "1/3", 0.0),
    ("#### 1/0", "5", 0.0),
    ("#### 1000000.0000001", "1000000", 1.0),
    ("#### 1" + "0" * 400, "#### 1" + "0" * 401, 0.0),
    ("#### 1e400", "5", 0.0),
    ("So 2 + 2 = 4 and \\boxed{\\text{9 apples}} then 11", "9", 1.0),
    ("A discount of 25%", "25", 1.0),
]

# Issue #35: hedges (the right value 3 with a wrong one: right value 0.0) and committed answers (1.0).
HEDGES: list[tuple[str, str, float]] = [
    ("\\boxed{3}\n\nLet me double-check. \\boxed{4}", "3", 0.0),
    ("\\boxed{4} or \\boxed{3}", "3", 0.0),
    ("\\boxed{3, 4}", "3", 0.0),
    ("\\boxed{4 \\text{ or } 3}", "3", 0.0),
    ("\\boxed{\\pm 3}", "3", 0.0),
    ("#### 4 or 3", "3", 0.0),
    ("#### 3 (or 4)", "3", 0.0),
    ("the answer is 3 (or maybe 5)", "3", 0.0),
    ("The answer is 5 (or maybe 3).", "3", 0.0),
    ("#### 4\nwait, no\n#### 3", "3", 0.0),
    ("The final answer is 4. The final answer is 3.", "3", 0.0),
    ("either 12, 13 or 3", "3", 0.0),
    ("\\boxed{3}\nThe final answer is 4.", "3", 0.0),
    ("It is between 1 and 3.", "3", 0.0),
    ("\\boxed{3}. Or maybe 5.", "3", 0.0),
    ("\\boxed{3}\n\nSo the answer is \\boxed{3}.", "3", 1.0),
    ("The answer is 3.\n#### 3", "3", 1.0),
    ("She has 12 apples and gives away 9, so 12 - 9 = 3.\n#### 3", "3", 1.0),
    ("So 12 - 9 = 3.", "3", 1.0),
    ("#### $3", "3", 1.0),
    ("\\boxed{3 \\text{ apples}}", "3", 1.0),
]

# LaTeX forms beyond a plain number (none occurs in GSM8K references, all integers).
LATEX: list[tuple[str, str, float]] = [
    ("\\boxed{10^{3}}", "1000", 1.0),
    ("\\boxed{1.5 \\times 10^3}", "1500", 1.0),
    ("\\boxed{\\sqrt{16}}", "4", 1.0),
    ("\\boxed{3 \\cdot 4}", "12", 1.0),
    ("\\boxed{\\frac{10}{4}}", "2.5", 1.0),
    ("\\boxed{2.5\\%}", "2.5", 1.0),
    ("\\boxed{\\$5}", "5", 1.0),
]

ONE_MB = 1_000_000
BIG: list[tuple[str, str]] = [
    ("1 MB of digits", "1" * ONE_MB),
    ("1 MB of '1 '", "1 " * (ONE_MB // 2)),
    ("1 MB of '2 1/2 '", "2 1/2 " * (ONE_MB // 6)),
    ("1 MB of '-$'", "-$" * (ONE_MB // 2) + "5"),
    ("1 MB of '\\boxed{'", "\\boxed{" * (ONE_MB // 7)),
    ("1 MB of '#### x '", "#### x " * (ONE_MB // 7)),
    ("1 MB prose + '#### 5'", "The farmer sells eggs. " * (ONE_MB // 23) + "\n#### 5"),
    ("10 kB prose + '#### 5'", "The farmer sells eggs. " * (10_000 // 23) + "\n#### 5"),
    ("nested braces x2000", "\\boxed{" + "{" * 2000 + "5" + "}" * 2000 + "}"),
    ("nested \\frac x200", "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}"),
    ("\\boxed{2^{2^{2^{2^{2^{2}}}}}}", "\\boxed{2^{2^{2^{2^{2^{2}}}}}}"),
]


def _math_verify(completion: str, reference: str, **kw) -> float:
    from math_verify import parse, verify

    return 1.0 if verify(parse(reference, **kw.get("parse", {})), parse(completion, **kw.get("parse", {})),
                         **kw.get("verify", {})) else 0.0


def _timed(fn, *args, **kwargs) -> tuple[object, float]:
    t0 = time.perf_counter()
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:  # reported in the table
        out = f"raised {type(exc).__name__}"
    return out, time.perf_counter() - t0


def agreement_table(cases: list[tuple[str, str, float]]) -> None:
    print("| completion | reference | right | ours | math-verify |\n|---|---|---|---|---|")
    ours_ok = mv_ok = 0
    for completion, reference, right in cases:
        ours, mv = accuracy_reward(completion, reference), _math_verify(completion, reference)
        ours_ok += ours == right
        mv_ok += mv == right
        print(f"| `{completion[:40]!r}` | `{reference[-20:]!r}` | {right} | {ours} | {mv} |")
    print(f"\nright: ours {ours_ok}/{len(cases)}, math-verify {mv_ok}/{len(cases)}\n")


def gsm8k_references() -> None:
    """Each GSM8K test solution against its own answer (right 1.0) and against the next row's (right 0.0 where the
    two answers differ): seconds for the whole set and the count right."""
    if not GSM8K_TEST.exists():
        print(f"{GSM8K_TEST} not present\n")
        return
    rows = [json.loads(line)["answer"] for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
    pairs = [(a, a, 1.0) for a in rows]
    final = [a.rsplit("####", 1)[1].strip() for a in rows]
    pairs += [(rows[i], rows[i + 1], 0.0) for i in range(len(rows) - 1) if final[i] != final[i + 1]]
    print("| GSM8K test solutions | pairs | right | seconds |\n|---|---|---|---|")
    for name, fn in (("ours", accuracy_reward), ("math-verify", _math_verify)):
        t0 = time.perf_counter()
        ok = sum(fn(c, r) == right for c, r, right in pairs)
        print(f"| {name} | {len(pairs)} | {ok} | {time.perf_counter() - t0:.1f} |")
    print()


def timing_table() -> None:
    print("| input | ours (s) | math-verify (s) | math-verify result |\n|---|---|---|---|")
    for name, text in BIG:
        _, t_ours = _timed(accuracy_reward, text, "5")
        mv, t_mv = _timed(_math_verify, text, "5")
        print(f"| {name} | {t_ours:.3f} | {t_mv:.3f} | {mv} |")
    print()


def thread_table() -> None:
    """math-verify off the main thread: with its default timeouts, and with ``parsing_timeout=None`` /
    ``timeout_seconds=None`` (no signal, no time bound)."""
    results: dict[str, object] = {}

    def run(label: str, **kw) -> None:
        results[label] = _timed(_math_verify, "#### 5", "5", **kw)[0]

    for label, kw in (("default timeouts", {}),
                      ("timeouts off", {"parse": {"parsing_timeout": None}, "verify": {"timeout_seconds": None}})):
        t = threading.Thread(target=run, args=(label,), kwargs=kw)
        t.start()
        t.join()
    print("| math-verify in a non-main thread, '#### 5' vs '5' (right 1.0) | result |\n|---|---|")
    for label, value in results.items():
        print(f"| {label} | {value} |")
    print(f"| ours | {accuracy_reward('#### 5', '5')} |\n")


def ray_table() -> None:
    """math-verify inside Ray actors (local cluster, 1 CPU): a plain actor (methods on the worker's main thread) and
    a threaded one (``max_concurrency=2``: methods on a thread pool)."""
    import ray

    @ray.remote(num_cpus=0)
    class Scorer:
        def score(self) -> str:
            logging.getLogger("math_verify").setLevel(logging.CRITICAL)
            out, seconds = _timed(_math_verify, "#### 5", "5")
            return f"{out} ({threading.current_thread() is threading.main_thread() and 'main' or 'other'} thread)"

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        print("| math-verify in a Ray actor, '#### 5' vs '5' (right 1.0) | result |\n|---|---|")
        for label, options in (("plain actor", {}), ("max_concurrency=2", {"max_concurrency": 2})):
            actor = Scorer.options(**options).remote()
            print(f"| {label} | {ray.get(actor.score.remote(), timeout=120)} |")
    finally:
        ray.shutdown()
    print()


if __name__ == "__main__":
    import sys

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    agreement_table(CASES)
    agreement_table(HEDGES)
    agreement_table(LATEX)
    gsm8k_references()
    timing_table()
    thread_table()
    if "--ray" in sys.argv[1:]:
        ray_table()
