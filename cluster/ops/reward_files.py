"""The reward files ``grpo-cluster submit`` ships with a job, so the reward functions its spec names by location import
on the cluster; the agent file (``rollout.agent``, named the same way; an ecosystem environment's file or module,
``gymnasium:file.py:Id``) travels by the same rules.

On the cluster the validated spec is ``grpo_job_spec.yaml`` at the root of the uploaded working dir, and the job runs
from there: a key ``path/to/file.py:function`` (relative to the spec file here) resolves to ``<working dir>/path/to/
file.py`` there, and ``module:function`` finds a module in the working dir. So each such file is added to the upload
at that place, unless the upload already holds the same file there:

- ``path/to/file.py:function``: the file, at ``path/to/file.py``;
- ``module:function``: a single-file module found in the spec file's folder, at ``module.py``; a module in the working
  dir travels with it, an installed one must be installed on the cluster too.

Refused (:class:`cluster.ops.jobs.JobsError`, naming the spec field and the file): an absolute path or one that
leaves the spec's folder (``../x.py``: there is no place for it under the working dir), a package (a folder) from the
spec's folder, or a place where the working dir already has a different file. Only the named file travels: modules it
imports must be in the working dir or installed.
"""

from __future__ import annotations

import sys
from importlib.machinery import PathFinder
from pathlib import Path

from grpo.rewards.loading import RewardLocation

__all__ = ["reward_files"]


def _spec_reward_locations(spec, spec_dir: Path) -> list[tuple[str, RewardLocation]]:
    """(spec field, location) of every reward the spec names by location, and of its agent (``rollout.agent``; for
    an ecosystem environment, the file or module its id names, if any: ``EcosystemKind.source``)."""
    from cluster.agents.kinds import ecosystem_key
    from grpo.rewards.loading import is_location, locate_target, parse_location

    keys = [("algorithm.rewards", k) for k in spec.algorithm.rewards]
    if spec.eval is not None:
        keys += [(f"eval.{n}", getattr(spec.eval, n)) for n in ("accuracy_reward", "format_reward")]
    out = [(field, parse_location(key, spec_dir)) for field, key in keys if key is not None and is_location(key)]
    agent = spec.rollout.agent
    found = ecosystem_key(agent) if agent is not None else None
    if found is not None:
        target = found[0].source(found[1])
        if target is not None:
            out.append(("rollout.agent", locate_target(agent, target, spec_dir)))
    elif agent is not None and is_location(agent):
        out.append(("rollout.agent", parse_location(agent, spec_dir)))
    return out


def _module_file(name: str, spec_dir: Path) -> Path | None:
    """The file of the top-level module ``name`` as the job would import it here (installed packages first, then the
    spec's folder); None when it is not found."""
    spec = PathFinder.find_spec(name, [*sys.path, str(spec_dir)])  # finds without importing anything
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return None
    return Path(spec.origin)


def reward_files(spec, spec_dir: str | Path, root: str | Path) -> dict[str, str]:
    """The files (path relative to the working dir → text) to add to the upload of ``root`` (module docstring).

    Args:
        spec: the validated JobSpec (its reward functions were imported while validating it).
        spec_dir: the folder of the spec file (relative reward paths are taken from it).
        root: the folder uploaded as the working dir.

    Raises:
        JobsError: a reward file that cannot be placed under the working dir (module docstring), naming the field.
    """
    from cluster.ops.jobs import JobsError

    spec_dir, root = Path(spec_dir).resolve(), Path(root).resolve()
    out: dict[str, str] = {}
    for field, loc in _spec_reward_locations(spec, spec_dir):
        key = loc.key
        if loc.kind == "file":
            rel = Path(loc.target)
            if rel.is_absolute() or ".." in rel.parts or rel.parts[:1] == ("~",):
                raise JobsError(f"{field}: reward {key!r} names {loc.path}, outside the spec file's folder; submit "
                                f"ships reward files to the same place under the uploaded working dir, so name it "
                                f"by a path inside the spec's folder (move the file next to the spec)")
            src, dest = loc.path, rel.as_posix()
        else:
            top = loc.target.split(".")[0]
            src = _module_file(top, spec_dir)
            if src is None or src.is_relative_to(root) or not src.is_relative_to(spec_dir):
                continue  # in the working dir (uploaded) or installed (the cluster needs it installed too)
            if src.name == "__init__.py":
                named = f":{loc.function}" if loc.function else ""
                raise JobsError(f"{field}: reward {key!r} is in the package {src.parent}, outside the uploaded "
                                f"working dir {root}; submit ships single files only: move the package into the "
                                f"working dir, or name a file ('path/to/file.py{named}')")
            dest = f"{top}.py"
        there = root / dest
        if there.exists() and (there.resolve() == src.resolve() or there.read_bytes() == src.read_bytes()):
            continue
        if there.exists():
            raise JobsError(f"{field}: reward {key!r}: the uploaded working dir {root} already has a different "
                            f"{dest}, where the job would look for {src}; rename the reward file")
        out[dest] = src.read_text(encoding="utf-8")
    return out
