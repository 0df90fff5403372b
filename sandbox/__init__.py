"""Running model-written code: the sandbox, its process supervision, and the ``code`` rewards that judge programs.

    from sandbox import SandboxConfig, check_sandbox, run_program
    run_program("print(sum(map(int, input().split())))", stdin="2 3\\n")   # SandboxResult(status='passed', ...)

A package of its own beside ``grpo/`` (which keeps tensors and pure functions): everything here starts, watches and
kills processes. ``grpo`` names what it needs from here by import path (the ``code`` and ``code_asserts`` rewards,
the multi-turn ``python`` tool) and never imports it (docs/architecture.md).

- ``runner``: :func:`run_program`, :func:`run_programs`, :func:`check_sandbox` and the statuses;
  ``config``: :class:`SandboxConfig`, :class:`Program`, :class:`SandboxResult`;
- ``launch`` (the bwrap command line, uids), ``modes`` (bwrap and the weaker rlimits mode), ``process`` (the
  supervisor: pipes, wall time, output cap, killing), ``seccomp`` (no user namespaces inside);
- ``bootstrap`` (the first code the sandboxed interpreter runs) and ``harness`` (the test harness inside the sandbox,
  and the plain-data wire format);
- ``cases`` (a row's tests: call, stdin/stdout and assert cases), ``judge`` (harness requests and verdicts, outside
  the sandbox), ``programs`` (the program in a completion), ``code_reward`` (the rewards), ``asserts`` (assert-style
  test code turned into call cases, for HumanEval);
- ``python_tool``: the multi-turn ``python`` tool.

docs/sandbox.md: what the program sees, the limits, the test styles and the reward hacks each one stops.
"""

from sandbox.config import DEFAULT_SANDBOX, Program, SandboxConfig, SandboxMode, SandboxResult, SandboxStatus
from sandbox.runner import check_sandbox, run_program, run_programs

__all__ = ["DEFAULT_SANDBOX", "Program", "SandboxConfig", "SandboxMode", "SandboxResult", "SandboxStatus",
           "check_sandbox", "run_program", "run_programs"]
