"""The ``python`` tool of the ``tools`` environment (``grpo.environments.tool_env``): run a program the policy wrote
in the sandbox (:mod:`sandbox.runner`), with the limits the ``code`` rewards use (:data:`sandbox.DEFAULT_SANDBOX`,
or the tool environment's ``sandbox`` options).

Whose fault a failure is follows the sandbox's statuses: ``passed`` gives the program's stdout; the program's own
failures (``failed``: it raised or exited nonzero, ``timeout``, ``cpu_limit``, ``memory``, ``output_limit``) give an
error text the policy sees (its first line: the status and stderr's last line, a traceback's exception, so a cut to
the tool environment's ``max_output_chars`` keeps the cause; then stdout so far and the tail of stderr);
``infra_error`` (the sandbox could not run the program) raises :class:`grpo.environments.base.EnvironmentInfraError`:
the episode is an infrastructure failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from grpo.environments.base import EnvironmentInfraError
from sandbox.config import DEFAULT_SANDBOX, SandboxConfig
from sandbox.runner import run_program

__all__ = ["PythonTool", "python_tool", "sandbox_config"]

#: Characters of stderr shown after a failure (its end: the traceback's last lines).
STDERR_TAIL_CHARS = 600
#: Characters of stderr's last line (a traceback's exception) repeated on the first line of a failure's text, which
#: survives the tool environment's ``max_output_chars`` cut.
CAUSE_CHARS = 200


def sandbox_config(options: Mapping[str, Any] | None) -> SandboxConfig:
    """The code reward's sandbox config with ``options`` (``SandboxConfig`` fields, e.g. ``{"mode": "rlimits"}``)
    replaced; one program at a time per call.

    Raises:
        ValueError: an unknown field or a value ``SandboxConfig`` refuses.
    """
    fields = dict(options or {})
    known = set(SandboxConfig.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"sandbox: unknown field(s) {unknown}; expected SandboxConfig fields {sorted(known)}")
    return replace(DEFAULT_SANDBOX, **fields)


class PythonTool:
    """Runs ``{"code": "<python source>"}`` in the sandbox (module docstring).

    Args:
        config: the sandbox's mode and limits.
    """

    name = "python"
    description = 'python: {"code": "<a Python program>"} runs it and returns what it prints'

    def __init__(self, config: SandboxConfig):
        self.config = config

    def __call__(self, arguments: Mapping[str, Any]) -> tuple[bool, str]:
        """Run the program; returns (ran without error, the text the policy sees).

        Raises:
            EnvironmentInfraError: the sandbox could not run it.
        """
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return False, 'python: expected {"code": "<a Python program>"}'
        result = run_program(code, config=self.config)
        if result.infra_error:
            raise EnvironmentInfraError(f"python tool: the sandbox could not run the program: {result.detail}")
        if result.passed:
            return True, result.stdout.rstrip() if result.stdout.strip() else "(the program printed nothing)"
        why = result.detail or f"exit code {result.exit_code}"
        stderr = result.stderr.strip()[-STDERR_TAIL_CHARS:]
        cause = stderr.splitlines()[-1].strip()[:CAUSE_CHARS] if stderr else ""
        parts = [f"python: the program ended with status {result.status} ({why})" + (f": {cause}" if cause else "")]
        if result.stdout.strip():
            parts.append(f"stdout:\n{result.stdout.rstrip()}")
        if stderr:
            parts.append(f"stderr:\n{stderr}")
        return False, "\n".join(parts)


def python_tool(options: Mapping[str, Any] | None) -> PythonTool:
    """The tool the ``tools`` environment offers as ``python`` (``grpo.environments.tool_env.PYTHON_TOOL``): a
    :class:`PythonTool` with :func:`sandbox_config` of ``options``.

    Raises:
        ValueError: as :func:`sandbox_config`.
    """
    return PythonTool(sandbox_config(options))
