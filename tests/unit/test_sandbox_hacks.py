"""The reward hacks RL finds first, tried against every test style of the ``code`` rewards (tests/sandbox_hacks.py):
each hack's outcome per style is measured here and must be the one docs/sandbox.md's table says ("caught": the
program scores 0; "paid": it scores 1). Call and stdin/stdout cases catch every hack; test code run in the program's
own process (``code_asserts``) pays the ones the table marks, which the docs list as what that style does not catch.
Needs bwrap (skips without it); ≈ 15 s here."""

from __future__ import annotations

import re
import shutil
import socket
import threading
from pathlib import Path

import pytest

from sandbox import SandboxConfig, check_sandbox
from sandbox.code_reward import code_asserts_reward, code_reward
from tests.sandbox_hacks import ASSERTS, CALLS, STDIO, hack_programs

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sandbox.md"
#: The table's outcome columns, in order, and how each style is run.
STYLES = ("calls", "stdio", "asserts", "asserts_without_entry_point")
SANDBOX = SandboxConfig(cpu_time_s=2, wall_time_s=3, uid_base=61300, uid_count=64)
#: The controls: a right program and a wrong one (no hack), which pass and fail in every style.
CONTROLS = ("right", "wrong")

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed (Debian package "
                                 "bubblewrap; scripts/install_test_tools.sh installs it)")


def documented_outcomes() -> dict[str, tuple[str, ...]]:
    """hack → its outcome per style, from the rows of docs/sandbox.md's hack table (`` `name` | what | outcomes``)."""
    rows = {}
    for line in DOCS.read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `([a-z0-9_]+)` \|", line)
        if match and line.count("|") == len(STYLES) + 3:
            cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
            rows[match.group(1)] = tuple(cells[2:])
    return rows


def _word(name: str, score: float | None) -> str:
    """A score as the table writes it: a hack is caught (0) or paid (1); a control fails or passes."""
    if score is None:
        return "no score"
    if name in CONTROLS:
        return "passes" if score == 1.0 else "fails"
    return "paid" if score == 1.0 else "caught"


@pytest.fixture(scope="module")
def measured():
    """hack → outcome per style (every program of a style in one batch), and what the host listener received."""
    reason = check_sandbox(SANDBOX)
    if reason is not None:
        pytest.fail(reason)
    received: list[bytes] = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        stop = threading.Event()

        def listen() -> None:
            while not stop.is_set():
                try:
                    connection, _ = server.accept()
                except OSError:
                    continue
                with connection:
                    received.append(connection.recv(100))

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        programs = hack_programs(server.getsockname()[1])
        names = list(programs)
        completions = [f"```python\n{programs[name]}```" for name in names]
        n = len(names)
        scores = {
            "calls": code_reward(completions, [CALLS] * n, entry_point=["add"] * n, sandbox=SANDBOX),
            "stdio": code_reward(completions, [STDIO] * n, sandbox=SANDBOX),
            "asserts": code_asserts_reward(completions, [ASSERTS] * n, entry_point=["add"] * n, sandbox=SANDBOX),
            "asserts_without_entry_point": code_asserts_reward(completions, [ASSERTS] * n, sandbox=SANDBOX),
        }
        stop.set()
        listener.join()
    outcomes = {name: tuple(_word(name, scores[style][i]) for style in STYLES) for i, name in enumerate(names)}
    return outcomes, received


@needs_bwrap
def test_sandbox_hacks_table_in_the_docs_is_what_is_measured(measured):
    outcomes, _ = measured
    documented = documented_outcomes()
    assert set(documented) == set(outcomes), ("hacks tried but not in docs/sandbox.md's table, or the other way: "
                                              f"{sorted(set(documented) ^ set(outcomes))}")
    wrong = {name: (documented[name], outcomes[name]) for name in outcomes if documented[name] != outcomes[name]}
    assert not wrong, f"documented (calls, stdio, asserts, asserts without entry point) != measured: {wrong}"


@needs_bwrap
def test_sandbox_hacks_every_one_is_caught_by_call_and_stdio_cases(measured):
    outcomes, received = measured
    assert outcomes["right"] == ("passes",) * 4 and outcomes["wrong"] == ("fails",) * 4
    paid = {name: o[:2] for name, o in outcomes.items() if name not in CONTROLS and "paid" in o[:2]}
    assert paid == {}, f"hacks paid by call or stdin/stdout cases: {paid}"
    assert received == [], f"a sandboxed program reached the host's 127.0.0.1: {received}"


@needs_bwrap
def test_sandbox_hacks_test_code_catches_exits_objects_and_builtins_with_an_entry_point(measured):
    """What the ``asserts`` style does stop (the rest is the docs' list of what it does not)."""
    outcomes, _ = measured
    caught = ["exit_0_before_the_tests", "os_exit_0_inside_a_test", "raise_system_exit_inside_a_test",
              "atexit_exit_0_after_failing", "fork_parent_exits_0", "always_equal_object", "int_subclass_always_equal",
              "array_like_comparison", "patch_builtins_abs", "read_tests_from_files", "forge_frames_and_markers"]
    assert {name: outcomes[name][2] for name in caught} == dict.fromkeys(caught, "caught")


def test_sandbox_hack_code_refuses_test_code_so_the_spec_must_choose_it():
    with pytest.raises(ValueError, match="case 0 is Python test code.*choose the reward 'code_asserts'"):
        code_reward(["```python\ndef add(a, b):\n    return a + b\n```"], [ASSERTS])
    with pytest.raises(ValueError, match="case 1 is Python test code"):
        code_reward.check_row(tests=[CALLS[0], ASSERTS], entry_point="add")
