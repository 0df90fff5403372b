"""``grpo-cluster spec --defaults | --schema``: the job spec described by itself (:mod:`cluster.spec.reference`).

    grpo-cluster spec --defaults > job.yaml                   # a complete spec that `grpo-cluster validate` accepts
    grpo-cluster spec --schema > grpo-cluster.schema.json     # JSON Schema: editor completion and checks

Exit codes: 0 printed; 2 the spec's own checks failed (only without the ``tasks`` extra, which the defaults' data
source needs).
"""

from __future__ import annotations

import json
import sys


def _cmd_spec(args) -> int:
    from pydantic import ValidationError

    from cluster.spec.reference import default_spec_yaml, spec_json_schema

    if args.schema:
        print(json.dumps(spec_json_schema(), indent=2))
        return 0
    try:
        text = default_spec_yaml()
    except ValidationError as exc:
        print(f"grpo-cluster spec: the defaults do not validate here: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


def add_spec_command(sub) -> None:
    """Add ``spec`` to the ``grpo-cluster`` subparsers ``sub``."""
    p = sub.add_parser("spec", help="print a complete spec of defaults (--defaults) or the spec's JSON Schema")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--defaults", action="store_true", help=(
        "a complete job spec (YAML) with every field at its default; `validate` accepts it"))
    what.add_argument("--schema", action="store_true", help=(
        "the job spec's JSON Schema (for editors: yaml-language-server, VS Code's YAML extension)"))
    p.set_defaults(func=_cmd_spec)
