"""A coding agent written with the openai client (docs/agents.md): it asks the model for a Python function, runs the
row's tests in the sandbox, shows the model what failed and lets it try again, up to `attempts` times.

    rollout: {agent: agent.py:run, agent_options: {attempts: 3}}      # examples/code_agent/spec.yaml

Rows come from `data.source: code_functions` ({"prompt": "Write a Python function `add_number(x)` that returns x
plus 7.", "tests": [{"args": [3], "expected": 10}, ...], "entry_point": "add_number"}). The tests run in the sandbox
(sandbox.test_report.run_tests: the `code` reward's program, harness and judge), never in this process.

Reward: 1 when the last attempt passes every test, plus 0.5 when the first attempt did. The other parts of the dict
(logged as reward/<name>) say how the episode went: accuracy (the last attempt passed; held-out pass@1 reads it),
first_try, attempts (model calls), ran (share of attempts whose program ran without raising, right or wrong).
"""

import asyncio

from sandbox.test_report import run_tests

SYSTEM = "You are a Python programmer. Reply with the function in one ```python code block."
# One worked exchange, a failed test and its fix included: a 135M model copies the format it is shown.
EXAMPLE = [
    {"role": "user",
     "content": "Write a Python function `last_item(xs)` that returns the last element of the list xs."},
    {"role": "assistant", "content": "```python\ndef last_item(xs):\n    return xs[0]\n```"},
    {"role": "user", "content": "The tests failed:\nlast_item([4, 8, 2]) returned 4, expected 2\nFix the function."},
    {"role": "assistant", "content": "```python\ndef last_item(xs):\n    return xs[-1]\n```"},
]


def first_messages(row) -> list[dict]:
    """The first call's messages: the system prompt, the worked exchange, the task."""
    return [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": row["prompt"]}]


async def run(client, row, attempts: int = 3, max_tokens: int = 96, show_failures: int = 2):
    messages = first_messages(row)
    ran = 0
    for attempt in range(1, attempts + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
        answer = reply.choices[0].message.content or ""
        report = await asyncio.to_thread(run_tests, answer, row["tests"], row["entry_point"])
        if report.passed is None:  # the sandbox failed, not the model: no reward
            return None
        ran += report.ran
        if report.passed:
            break
        feedback = f"The tests failed:\n{report.feedback(show_failures)}\nFix the function."
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": feedback}]
    passed, first = float(report.passed), float(report.passed and attempt == 1)
    return {"reward": passed + 0.5 * first, "accuracy": passed, "first_try": first, "attempts": float(attempt),
            "ran": ran / attempt}
