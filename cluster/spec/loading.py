"""Reading a job spec: YAML text with file:line errors, ``--set`` overrides, and writing a spec back as YAML.

Loading (:func:`load_spec`)::

    spec = load_spec("examples/gsm8k_smollm2_cpu.yaml", ["rollout.group_size=8", "train.lr=1e-6"])

- Overrides are ``dotted.key=value``; the value is parsed as YAML (``4`` → int, ``true`` → bool, ``[1, 2]`` →
  list, an empty value → null). An unknown dotted key is an error that lists the valid keys at that level.
- Relative paths: ``data.train_path`` / ``data.test_path`` / ``eval.data_path`` / ``data.chat_template`` (a file)
  written in the YAML file are resolved against the YAML file's folder when the file exists there (so a spec can
  name data next to it), otherwise they are left as written, relative to the working directory. ``model.path``
  likewise, when it names an existing folder next to the spec. Reward functions named by file (``algorithm.rewards``
  keys ``path/to/file.py:function``) are found relative to the YAML file's folder too, and imported while the spec is
  validated (``cluster.spec.algorithm.check_reward_key``; the folder is the validation context's ``base_dir``); the
  key stays as written (it is the metric name). Everything else (``output_dir``, ``checkpoint.dir``,
  ``model.cache_dir``) is relative to the working directory, as for any CLI tool. Values given with ``--set`` are
  never rewritten.
- Every problem is reported in one :class:`SpecError`, one line each:
  ``<file>:<line>: <dotted.field>: <message> (got <value>)``, with ``--set <key>`` in place of the line for
  values that came from an override (of the field, a section above it, or a key inside it).
- Integer fields are strict: ``4`` is accepted, ``true``, ``"4"`` and ``4.0`` are not (``--set x=4`` parses as an
  int). Float fields take ints and floats, not ``true`` or ``"0.5"``. Counts and sizes have upper bounds that catch
  a mistyped extra digit.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cluster.spec.errors import Loc, format_errors, model_at, problem_line, unknown_key_message, where
from cluster.spec.job import JobSpec

__all__ = ["SpecError", "load_spec", "load_spec_text", "locate_field_error", "spec_to_yaml"]


class SpecError(ValueError):
    """A job spec could not be read or validated; the message lists every problem, one per line."""



class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader, also reading exponent floats without a dot (``1e-3``, ``2E5``) as floats, as YAML 1.2
    and JSON do; YAML 1.1 (PyYAML) reads them as strings, which strict fields (``rollout.resources`` amounts) then
    refuse as "not a valid number"."""


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


class _SpecDumper(yaml.SafeDumper):
    """PyYAML's safe dumper with :class:`_SpecLoader`'s float rule, so a string like "1e5" is written quoted and
    read back as a string."""


_SpecDumper.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _safe_load(text: str) -> Any:
    """``yaml.safe_load`` with :class:`_SpecLoader` (a SafeLoader: no arbitrary objects)."""
    return yaml.load(text, Loader=_SpecLoader)


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> JobSpec:
    """Read a YAML job spec, apply ``dotted.key=value`` overrides, validate; raises SpecError on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: spec file not found (cwd: {Path.cwd()})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read spec file: {exc}") from None
    return load_spec_text(text, source=str(path), base_dir=path.parent, overrides=overrides)


def load_spec_text(text: str, *, source: str = "<string>", base_dir: str | Path | None = None,
                   overrides: Sequence[str] = ()) -> JobSpec:
    """Like :func:`load_spec` for YAML text; ``source`` names it in errors, ``base_dir`` anchors data paths."""
    try:
        root = yaml.compose(text, Loader=_SpecLoader)
    except yaml.YAMLError as exc:
        raise SpecError(_yaml_error_message(exc, source)) from None
    lines: dict[Loc, int] = {}
    if root is not None:
        _collect_lines(root, (), lines, source)  # first: refuses aliases before anything is built from them
    try:
        data = _safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(_yaml_error_message(exc, source)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{source}:1: expected a mapping of top-level keys "
                        f"({', '.join(JobSpec.model_fields)}), got {type(data).__name__}")
    if base_dir is not None:
        _resolve_relative_paths(data, Path(base_dir))
    for section in [k for k, v in data.items() if v is None and model_at((str(k),)) is not None
                    and JobSpec.model_fields[str(k)].default is not None]:
        data[section] = {}  # a section whose keys are all commented out means "all defaults" (optional ones: off)
    set_by = _apply_overrides(data, overrides)
    try:
        return JobSpec.model_validate(data, context={"base_dir": str(base_dir) if base_dir is not None else None})
    except ValidationError as exc:
        raise SpecError(format_errors(exc, source, lines, set_by)) from None


def locate_field_error(message: str, path: str | Path, overrides: Sequence[str] = ()) -> str:
    """``message`` prefixed with where its field's value came from, when it starts with a spec field (``model.path:
    model folder ... not found`` → ``job.yaml:11: model.path: ...`` or ``--set model.path: model folder ...``), for
    the input checks made after the spec is valid (model, data, output folders). Other messages, or a spec file
    that can no longer be read, are returned unchanged."""
    field = message.split(": ", 1)[0] if ": " in message else ""
    loc = tuple(field.split("."))
    if not field or loc[0] not in JobSpec.model_fields or (len(loc) > 1 and (
            (cls := model_at(loc[:-1])) is None or loc[-1] not in cls.model_fields)):
        return message
    lines: dict[Loc, int] = {}
    try:
        root = yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=_SpecLoader)
        if root is not None:
            _collect_lines(root, (), lines, str(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, SpecError):
        return message
    set_by = {tuple(raw.partition("=")[0].strip().split(".")): raw.partition("=")[0].strip() for raw in overrides}
    return problem_line(where(loc, str(path), lines, set_by), loc, message.split(": ", 1)[1])


def spec_to_yaml(spec: JobSpec) -> str:
    """Serialise a spec to YAML text that :func:`load_spec_text` reads back into an equal spec."""
    return yaml.dump(spec.model_dump(mode="json"), Dumper=_SpecDumper, sort_keys=False, allow_unicode=True)


def _yaml_error_message(exc: yaml.YAMLError, source: str) -> str:
    """``file:line: invalid YAML: [context (line N): ]problem`` from a PyYAML error."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{source}:{mark.line + 1}" if mark is not None else source
    problem = getattr(exc, "problem", None) or str(exc)
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        problem = f"{context} (line {context_mark.line + 1}): {problem}"
    return f"{where}: invalid YAML: {problem}"


def _collect_lines(node: yaml.Node, prefix: Loc, lines: dict[Loc, int], source: str,
                   seen: set[int] | None = None) -> None:
    """Map dotted paths to 1-based line numbers (a key's line, or a list item's); duplicate keys are errors.

    Raises:
        SpecError: a duplicate key, or a YAML alias (``*name``): a node met twice. Specs need no aliases, and
            refusing them stops recursive aliases and exponential "billion laughs" documents at once.
    """
    seen = set() if seen is None else seen
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        if id(node) in seen:
            where = ".".join(prefix) or "the top level"
            raise SpecError(f"{source}:{node.start_mark.line + 1}: {where}: YAML aliases (*name) are not supported "
                            f"in job specs; write the value out")
        seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            loc = (*prefix, str(key_node.value))
            line = key_node.start_mark.line + 1
            if loc in lines:
                raise SpecError(f"{source}:{line}: {'.'.join(loc)}: duplicate key "
                                f"{key_node.value!r} (first at line {lines[loc]})")
            lines[loc] = line
            _collect_lines(value_node, loc, lines, source, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            loc = (*prefix, str(index))
            lines[loc] = item.start_mark.line + 1
            _collect_lines(item, loc, lines, source, seen)


def _resolve_relative_paths(data: dict, base_dir: Path) -> None:
    """Rewrite data.*_path, data.chat_template and eval.data_path (existing files) and model.path (existing folders)
    found next to the spec file."""
    for section, key, exists in (("data", "train_path", Path.is_file), ("data", "test_path", Path.is_file),
                                 ("eval", "data_path", Path.is_file), ("model", "path", Path.is_dir),
                                 ("data", "chat_template", Path.is_file)):
        block = data.get(section)
        value = block.get(key) if isinstance(block, dict) else None
        if (isinstance(value, str) and value and not os.path.isabs(value) and not value.startswith("builtin:")
                and "{" not in value and "\n" not in value):
            candidate = base_dir / os.path.expanduser(value)
            if exists(candidate):
                block[key] = os.path.normpath(os.path.abspath(candidate))


def _check_override_key(loc: Loc, raw: str) -> None:
    """Raise SpecError unless loc names a spec field (or an entry of a dict-valued field)."""
    for depth, part in enumerate(loc):
        parent = loc[:depth]
        cls = model_at(parent)
        if cls is None:
            field = model_at(parent[:-1]).model_fields[parent[-1]]
            if getattr(field.annotation, "__origin__", None) is dict and depth == len(loc) - 1:
                return
            raise SpecError(f"--set {raw}: {'.'.join(parent)} is a value, not a section; "
                            f"cannot set {'.'.join(loc)!r}")
        if part not in cls.model_fields:
            level = ".".join(parent) or "top level"
            raise SpecError(f"--set {raw}: {unknown_key_message(part, list(cls.model_fields), level)}")


def _apply_overrides(data: dict, overrides: Sequence[str]) -> dict[Loc, str]:
    """Apply ``dotted.key=value`` strings in order; returns {loc: dotted key} of what they set."""
    set_by: dict[Loc, str] = {}
    for raw in overrides:
        key, sep, text = raw.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError(f"--set {raw!r}: expected 'dotted.key=value', e.g. 'rollout.group_size=8'")
        loc = tuple(key.split("."))
        if any(not part for part in loc):
            raise SpecError(f"--set {raw!r}: empty segment in key {key!r}; expected 'section.field=value'")
        _check_override_key(loc, raw)
        try:
            value = _safe_load(text)
        except yaml.YAMLError:
            value = text
        block = data
        for part in loc[:-1]:
            if not isinstance(block.get(part), dict):
                block[part] = {}
            block = block[part]
        block[loc[-1]] = value
        set_by[loc] = key
    return set_by
