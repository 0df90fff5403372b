"""The working dir a submitted job uploads: which files (links followed as Ray follows them, build outputs and
caches left out), its size limit, and the staged copy (``grpo-cluster submit``, :mod:`cluster.ops.jobs`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

__all__ = ["MAX_UPLOAD_BYTES", "UPLOAD_EXCLUDES", "JobsError", "project_root", "stage_working_dir", "upload_files"]

UPLOAD_EXCLUDES = (".venv", "venv", ".git", "runs", "outputs", "build", "dist", "__pycache__", "*.pyc", "*.egg-info",
                   ".pytest_cache", ".ruff_cache", ".mypy_cache", ".ipynb_checkpoints", ".whl", ".gl")
"""Names (glob patterns, any depth) left out of the uploaded working dir."""
MAX_UPLOAD_BYTES = 100 * 2**20
"""A staged working dir above this size is refused (Ray's own limit is 500 MiB; ours keeps submissions fast)."""

class JobsError(RuntimeError):
    """A Jobs API request cannot be done as asked; the message says why (printed as is, exit code 2)."""


def project_root() -> Path:
    """The folder holding ``cluster/`` and ``pyproject.toml``; raises JobsError for an installed (non-editable)
    package, which has no project folder to upload."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise JobsError(f"{root} is not a grpo-cluster project folder (no pyproject.toml); pass --working-dir")
    return root


def upload_files(root: Path) -> list[tuple[Path, int, str | None]]:
    """The files a job's working dir holds once staged from ``root``: what Ray zips and uploads.

    Links are followed the way Ray's packaging does (``ray/_private/runtime_env/packaging.py``: ``_dir_travel``
    recurses into ``is_dir()`` paths and ``_zip_files`` writes every ``is_file()`` path, both following links): a link
    to a file counts as the file it points to, a link to a folder as everything in it, a broken link as nothing.
    Names matching UPLOAD_EXCLUDES (any depth) are left out.

    Returns:
        (path relative to ``root``, size in bytes, link target or None), in walk order.
    Raises:
        JobsError: a link to a folder that contains it or contains ``root`` (Ray would follow it without end),
            refused at the link before anything under it is walked (a link to ``/`` or ``..`` is not walked); a
            folder that cannot be listed.
    """
    ignore = shutil.ignore_patterns(*UPLOAD_EXCLUDES)
    found: list[tuple[Path, int, str | None]] = []

    def walk(folder: Path, rel: Path, ancestors: frozenset) -> None:
        try:
            names = sorted(os.listdir(folder))
        except OSError as exc:
            raise JobsError(f"cannot list {rel or '.'} in {root} to size the upload: {exc}") from None
        skipped = ignore(str(folder), names)
        for name in (n for n in names if n not in skipped):
            path = folder / name
            target = os.readlink(path) if path.is_symlink() else None
            if path.is_dir():
                real = path.resolve()
                if any(ancestor.is_relative_to(real) for ancestor in ancestors):
                    raise JobsError(f"{rel / name} in {root} is a link to {real}, a folder that contains it: the "
                                    f"upload would never end; remove the link or pass another --working-dir")
                walk(path, rel / name, ancestors | {real})
            elif path.is_file():
                found.append((rel / name, path.stat().st_size, target))

    walk(root, Path(), frozenset({root.resolve()}))
    return found


def stage_working_dir(root: Path, dest: Path, files: Mapping[str, str] = {}) -> Path:
    """Copy ``root`` into ``dest`` without UPLOAD_EXCLUDES, add ``files`` (relative name → text); returns ``dest``.

    The size is checked first, before anything is copied, over :func:`upload_files` — links followed as Ray follows
    them. The copy is of exactly those files, links followed (a link becomes the file or folder it points to; broken
    links and empty folders are left out), so what Ray zips from ``dest`` is what was counted, whether a link is
    absolute or relative.

    Raises:
        JobsError: the upload would exceed MAX_UPLOAD_BYTES (naming the largest files, with their link targets and
            sizes), or a link to a folder that contains it.
    """
    sizes = sorted(upload_files(root), key=lambda f: f[1], reverse=True)
    total = sum(size for _, size, _ in sizes) + sum(len(text.encode()) for text in files.values())
    if total > MAX_UPLOAD_BYTES:
        largest = ", ".join(f"{rel}{f' -> {target}' if target else ''} ({size / 2**20:.1f} MiB)"
                            for rel, size, target in sizes[:5])
        raise JobsError(f"the working dir to upload from {root} is {total / 2**20:.0f} MiB (links followed, as Ray "
                        f"does), over the {MAX_UPLOAD_BYTES / 2**20:.0f} MiB limit; largest files: {largest}. Move "
                        f"them out of the project folder or pass a smaller --working-dir")
    for rel, _, _ in sizes:  # copy2 follows links (shutil.copytree would drop relative ones as dangling)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel)
    dest.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text(text, encoding="utf-8")
    return dest
