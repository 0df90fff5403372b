"""Reward functions a job spec names by where they live, so a spec is self-contained.

A key of ``algorithm.rewards`` (or ``eval.accuracy_reward`` / ``eval.format_reward``) is one of:

- a registered name (``accuracy``, ``format``, ``math``, ``reasoning_gym``, or one registered with
  ``@grpo.rewards.register_reward_function("name")`` by a module imported first, ``--import MODULE``);
- ``module:function``: ``function`` of an importable module (``my_rewards:exact_match``,
  ``pkg.rewards:score``); the spec file's folder and the working folder are searched after the installed packages;
- ``path/to/file.py:function``: ``function`` defined in that file, the path relative to the spec file's folder (like
  data paths) or absolute; the file's own folder is importable while it loads (``import helpers`` next to it works).

:func:`register_spec_reward` imports it and registers the function under the key as written, which is also its
metric name (``reward/reward.py:exact_match``). A key loaded again from another file replaces the earlier entry
(a process that loads two specs); a name registered by code is never replaced. Every problem (file not found,
module not importable, an error while importing, no such function, an unusable signature) is a
:class:`grpo.rewards.calling.RewardError` naming the key, the file and, where there is one, the line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from grpo.rewards.calling import RewardError, signature_of

__all__ = ["HOW_TO_NAME_A_REWARD", "RewardLocation", "import_target", "is_location", "load_located", "load_reward",
           "locate_target", "parse_location", "register_spec_reward", "spec_reward_base_dir"]

HOW_TO_NAME_A_REWARD = (
    "register one with @grpo.rewards.register_reward_function('name') in a module given to --import, or name a "
    "function in the spec as 'module:function' or 'path/to/file.py:function' (relative to the spec file)")

_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_SPEC_LOADED: dict[str, Callable] = {}  # key -> the function this module registered under it
_SPEC_BASE_DIRS: dict[str, Path] = {}  # key -> the folder it was loaded relative to


@dataclass(frozen=True)
class RewardLocation:
    """Where a spec-named reward lives.

    Attributes:
        key: the spec key as written. kind: ``file`` or ``module``. target: the module name, or the path as
            written. function: the attribute to take. path: the resolved file (kind ``file``), else None.
    """

    key: str
    kind: Literal["file", "module"]
    target: str
    function: str
    path: Path | None


def is_location(key: str) -> bool:
    """Whether ``key`` names a function by location (``module:function`` or ``file.py:function``)."""
    return ":" in key


def parse_location(key: str, base_dir: str | Path | None = None, what: str = "reward") -> RewardLocation:
    """Split ``key`` into its module or file and its function; a relative file is resolved against ``base_dir``
    (default: the working folder). ``what`` names the thing in messages (``reward``, ``agent``).

    Raises:
        RewardError: not ``target:function`` with a Python identifier as function and a module name or ``.py`` path
            as target.
    """
    target, _, function = key.rpartition(":")
    if not target or not function.isidentifier():
        raise RewardError(f"{what} {key!r}: expected 'module:function' or 'path/to/file.py:function' with a Python "
                          f"function name after the last ':', got {function!r}")
    return locate_target(key, target, base_dir, what, function)


def locate_target(key: str, target: str, base_dir: str | Path | None = None, what: str = "reward",
                  function: str = "") -> RewardLocation:
    """The location of ``target`` (a module name or a ``.py`` path, relative to ``base_dir``) for the spec key
    ``key`` (as :func:`parse_location` locates the target of ``target:function``).

    Raises:
        RewardError: neither a module name nor a ``.py`` path.
    """
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(os.path.expanduser(target))
        if not path.is_absolute():
            path = Path(base_dir or os.getcwd()) / path
        return RewardLocation(key, "file", target, function, Path(os.path.normpath(os.path.abspath(path))))
    if not _MODULE_RE.fullmatch(target):
        raise RewardError(f"{what} {key!r}: {target!r} is neither a module name (dotted identifiers) nor a .py file")
    return RewardLocation(key, "module", target, function, None)


def _add_to_path(*folders: Path) -> None:
    """Append folders to ``sys.path`` (after the installed packages, so a spec's folder never shadows them)."""
    for folder in folders:
        text = str(folder)
        if text not in sys.path:
            sys.path.append(text)


def _failure_site(exc: BaseException, path: Path | None) -> str:
    """``file:line`` where an import failed: a SyntaxError's own, else the deepest frame in ``path`` (else the
    deepest frame at all)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if path is not None and Path(f.filename) == path] or frames[-1:]
    return f"{mine[-1].filename}:{mine[-1].lineno}" if mine else str(path or "?")


def _import_file(loc: RewardLocation, what: str = "reward"):
    path = loc.path
    if not path.is_file():
        problem = "is a folder" if path.is_dir() else "not found"
        raise RewardError(f"{what} {loc.key!r}: file {path} {problem} (a relative path is taken from the spec file's "
                          f"folder){f'; expected a Python file defining {loc.function}()' if loc.function else ''}")
    stem = re.sub(r"\W", "_", path.stem)
    name = f"grpo_spec_reward_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}_{stem}"
    mtime = path.stat().st_mtime_ns
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__grpo_mtime__", None) == mtime:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # no loader for the file's suffix: not Python source (or bytecode)
        raise RewardError(f"{what} {loc.key!r}: file {path} is not a Python file (no .py name); expected a .py "
                          f"file{f' defining {loc.function}()' if loc.function else ''}")
    _add_to_path(path.parent)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up while it executes
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any error in user code, with its location, no traceback
        sys.modules.pop(name, None)
        raise RewardError(f"{what} {loc.key!r}: {_failure_site(exc, path)}: cannot import {path}: "
                          f"{type(exc).__name__}: {exc}") from None
    module.__grpo_mtime__ = mtime
    return module


def _import_module(loc: RewardLocation, base_dir: Path, what: str = "reward"):
    _add_to_path(base_dir, Path.cwd())
    try:
        return importlib.import_module(loc.target)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (loc.target == exc.name or loc.target.startswith(exc.name + ".")):
            raise RewardError(f"{what} {loc.key!r}: no module {exc.name!r} among the installed packages, the spec "
                              f"file's folder ({base_dir}) and the working folder ({Path.cwd()}); put "
                              f"{loc.target.split('.')[0]}.py there, or name the file: 'path/to/file.py"
                              f"{':' + loc.function if loc.function else ''}'") from None
        raise RewardError(f"{what} {loc.key!r}: {_failure_site(exc, None)}: cannot import {loc.target}: "
                          f"{type(exc).__name__}: {exc}") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - as in _import_file
        raise RewardError(f"{what} {loc.key!r}: {_failure_site(exc, None)}: cannot import {loc.target}: "
                          f"{type(exc).__name__}: {exc}") from None


def import_target(key: str, target: str, base_dir: str | Path | None = None, what: str = "reward"):
    """Import the module or file ``target`` (``module.name`` or ``path/to/file.py``, relative to ``base_dir``, the
    spec file's folder, which is importable; default the working folder) as :func:`load_located` imports the target
    of a ``target:function`` key, and return the module. ``key`` is the spec key as written, for messages.

    Raises:
        RewardError: naming the key, the file and line: not found, not a module name nor a ``.py`` path, fails to
            import.
    """
    base = Path(base_dir or os.getcwd()).resolve()
    loc = locate_target(key, target, base, what)
    return _import_file(loc, what) if loc.kind == "file" else _import_module(loc, base, what)


def load_reward(key: str, base_dir: str | Path | None = None) -> Callable:
    """Import the function ``key`` names (module docstring) and check its signature.

    Args:
        key: ``module:function`` or ``path/to/file.py:function``.
        base_dir: the spec file's folder (relative files are taken from it; it is importable); default the working
            folder.

    Raises:
        RewardError: naming the key, the file and line: not found, fails to import, no such function, not callable,
            or an unusable signature (``grpo.rewards.calling.signature_of``).
    """
    fn = load_located(key, base_dir)
    signature_of(fn, key)
    return fn


def load_located(key: str, base_dir: str | Path | None = None, what: str = "reward") -> Callable:
    """Import the callable ``key`` names (``module:function`` or ``path/to/file.py:function``, module docstring)
    without checking its signature; ``what`` names it in messages (``reward``, ``agent``: ``rollout.agent`` is
    loaded the same way, ``cluster.agents.loading``).

    Raises:
        RewardError: naming the key, the file and line: not found, fails to import, no such function, not callable.
    """
    base = Path(base_dir or os.getcwd()).resolve()
    loc = parse_location(key, base, what)
    module = _import_file(loc, what) if loc.kind == "file" else _import_module(loc, base, what)
    where = loc.path if loc.kind == "file" else getattr(module, "__file__", loc.target)
    fn = getattr(module, loc.function, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        raise RewardError(f"{what} {key!r}: {where} has no function {loc.function!r} (it defines: "
                          f"{', '.join(defined) or 'none'})")
    if not callable(fn):
        raise RewardError(f"{what} {key!r}: {where}: {loc.function!r} is a {type(fn).__name__}, not a function")
    return fn


def register_spec_reward(key: str, base_dir: str | Path | None = None) -> Callable:
    """:func:`load_reward` and register the function in ``grpo.rewards.REWARD_FUNCTIONS`` under ``key`` (replacing
    what an earlier spec registered there; a name registered by code is kept and returned).

    Raises:
        RewardError: as :func:`load_reward`; ValueError: the key is not a usable registry name (reserved).
    """
    from grpo.rewards import REWARD_FUNCTIONS

    if key in REWARD_FUNCTIONS and _SPEC_LOADED.get(key) is not REWARD_FUNCTIONS[key]:
        return REWARD_FUNCTIONS[key]  # registered by code (or a test): that one is meant
    fn = load_reward(key, base_dir)
    if key in REWARD_FUNCTIONS:
        dict.__delitem__(REWARD_FUNCTIONS, key)
    REWARD_FUNCTIONS[key] = fn
    _SPEC_LOADED[key] = fn
    _SPEC_BASE_DIRS[key] = Path(base_dir or os.getcwd()).resolve()
    return fn


def spec_reward_base_dir(key: str) -> Path | None:
    """The folder (absolute) the function registered under ``key`` was loaded relative to by
    :func:`register_spec_reward` (the spec file's), so another process can load it again with
    ``register_spec_reward(key, base_dir)``; None when ``key`` is not registered so (a name registered by code)."""
    from grpo.rewards import REWARD_FUNCTIONS

    if key not in _SPEC_LOADED or REWARD_FUNCTIONS.get(key) is not _SPEC_LOADED[key]:
        return None
    return _SPEC_BASE_DIRS[key]
