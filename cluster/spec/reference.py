"""The spec described by itself: a complete spec of defaults, and its JSON Schema (``grpo-cluster spec``).

- :func:`default_spec` / :func:`default_spec_yaml`: every field at its default, plus the few values a spec must give
  (``output_dir``, ``total_steps``, ``data``) chosen so that the result needs no file outside the project: a
  generated reasoning-gym task (``chain_sum``), which implies its own reward. ``grpo-cluster validate`` accepts it as
  printed.
- :func:`spec_json_schema`: :class:`~cluster.spec.job.JobSpec`'s JSON Schema (pydantic's, draft 2020-12), with the
  field descriptions, defaults, bounds and ``additionalProperties: false``, for editor completion (the
  ``yaml-language-server`` comment in :data:`SCHEMA_HINT`).

Imports only pydantic and :mod:`cluster.spec` modules.
"""

from __future__ import annotations

import copy
from typing import Any

from cluster.spec.job import JobSpec
from cluster.spec.loading import spec_to_yaml

__all__ = ["REQUIRED_CHOICES", "SCHEMA_HINT", "default_spec", "default_spec_yaml", "spec_json_schema"]

REQUIRED_CHOICES: dict[str, Any] = {
    "output_dir": "runs/grpo",
    "total_steps": 40,
    "data": {"source": "reasoning_gym",
             "reasoning_gym": {"task": "chain_sum",
                               "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
                               "answer_extraction": "last_number"}},
}
"""The values :func:`default_spec` sets beyond the defaults: the required fields (``output_dir``, ``total_steps``,
``data``). The generated task implies its own reward (``algorithm.rewards: {reasoning_gym: 1.0}``)."""

SCHEMA_HINT = "# yaml-language-server: $schema=grpo-cluster.schema.json"
"""The first line of a spec file that makes editors with the YAML language server (VS Code's YAML extension, neovim,
JetBrains) complete and check it against the schema written by ``grpo-cluster spec --schema >
grpo-cluster.schema.json``."""


def default_spec() -> JobSpec:
    """A valid spec with every field at its default except :data:`REQUIRED_CHOICES`.

    Raises:
        pydantic.ValidationError: only if the reasoning-gym task cannot be checked (the ``tasks`` extra is missing).
    """
    return JobSpec.model_validate(copy.deepcopy(REQUIRED_CHOICES))


def default_spec_yaml() -> str:
    """:func:`default_spec` as YAML, headed by comments that say what it is and which values are not defaults."""
    header = [
        SCHEMA_HINT,
        "# A complete grpo-cluster job spec, written by `grpo-cluster spec --defaults`: every field at its default",
        f"# except {', '.join(REQUIRED_CHOICES)}, which a spec must give (here: the generated chain_sum task,",
        "# scored by its own reward, so no data file is needed; the task also sets algorithm.rewards to",
        "# {reasoning_gym: 1.0} and its answer_extraction). docs/configuration.md describes every field.",
    ]
    return "\n".join(header) + "\n" + spec_to_yaml(default_spec())


def spec_json_schema() -> dict[str, Any]:
    """The JSON Schema of a job spec (a dict ready for ``json.dumps``), titled and identified for editors."""
    schema = JobSpec.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "grpo-cluster job spec", **schema}
