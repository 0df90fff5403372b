"""What ``grpo-cluster submit`` uploads: links in the project folder are followed as Ray's working_dir packaging
follows them, and the size limit counts what they point to (issue 12, section 2: a ``data.bin`` link to a 300 MiB
file was counted as 0 B and Ray then zipped 300 MiB)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.ops import jobs

MIB = 2**20


def _sparse(path: Path, size: int) -> Path:
    """A sparse file of ``size`` bytes (no disk used)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_link_to_a_300_mib_file_is_refused_naming_it_and_its_size(tmp_path):
    big = _sparse(tmp_path / "elsewhere" / "big.bin", 300 * MIB)
    root = tmp_path / "proj"
    (root / "cluster").mkdir(parents=True)
    (root / "cluster" / "cli.py").write_text("x")
    (root / "data.bin").symlink_to(big)
    with pytest.raises(jobs.JobsError) as err:
        jobs.stage_working_dir(root, tmp_path / "stage")
    assert f"data.bin -> {big} (300.0 MiB)" in str(err.value), err.value
    assert "is 300 MiB" in str(err.value)
    assert not (tmp_path / "stage").exists()  # refused before anything was copied


def test_link_to_a_folder_counts_its_files(tmp_path):
    _sparse(tmp_path / "weights" / "model.safetensors", 120 * MIB)
    root = tmp_path / "proj"
    root.mkdir()
    (root / "assets").symlink_to(tmp_path / "weights", target_is_directory=True)
    with pytest.raises(jobs.JobsError, match=r"assets/model\.safetensors \(120\.0 MiB\)"):
        jobs.stage_working_dir(root, tmp_path / "stage")


def test_link_to_an_enclosing_folder_is_refused(tmp_path):
    root = tmp_path / "proj"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "loop").symlink_to(root, target_is_directory=True)
    with pytest.raises(jobs.JobsError, match=r"sub/loop in .* is a link to .*proj, a folder that contains it"):
        jobs.upload_files(root)


def _tree_with_links(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "file.txt").write_bytes(b"a" * 10)
    (outside / "dir" / "inner.txt").write_bytes(b"b" * 20)
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_bytes(b"c" * 30)
    (root / "abs_file").symlink_to(outside / "file.txt")
    (root / "rel_file").symlink_to(Path("..") / "outside" / "file.txt")  # relative: must survive staging
    (root / "linked_dir").symlink_to(outside / "dir", target_is_directory=True)
    (root / "broken").symlink_to(tmp_path / "nowhere")
    (root / ".venv").mkdir()
    (root / ".venv" / "x").write_bytes(b"d")
    return root


def test_upload_files_agree_with_rays_packaging(tmp_path):
    """The files and sizes we count are the files Ray's own walk (``_dir_travel`` as ``_zip_files`` uses it) packs,
    and after staging Ray sees the same files in the staged copy."""
    from ray._private.runtime_env import packaging

    root = _tree_with_links(tmp_path)

    def rays_files(folder: Path) -> dict[str, int]:
        packed: dict[str, int] = {}

        def handler(path: Path) -> None:  # the condition _zip_files packs a path under
            if path.is_file():
                packed[str(path.relative_to(folder))] = path.stat().st_size

        packaging._dir_travel(folder, [packaging._get_excludes(folder, list(jobs.UPLOAD_EXCLUDES))], handler,
                              include_gitignore=False)
        return packed

    ours = {str(rel): size for rel, size, _ in jobs.upload_files(root)}
    expected = {"abs_file": 10, "rel_file": 10, "linked_dir/inner.txt": 20, "pkg/mod.py": 30}
    assert ours == expected
    assert {k: v for k, v in rays_files(root).items() if not k.startswith(".venv")} == expected
    dest = jobs.stage_working_dir(root, tmp_path / "stage")
    assert rays_files(dest) == expected
    assert not any(p.is_symlink() for p in dest.rglob("*"))
    assert {str(rel): target for rel, _, target in jobs.upload_files(root) if target} == {
        "abs_file": str(tmp_path / "outside" / "file.txt"), "rel_file": os.path.join("..", "outside", "file.txt"),
    }


@pytest.mark.parametrize("target", ["parent", "filesystem_root"])
def test_link_to_a_folder_above_the_project_is_refused_at_the_link(tmp_path, target):
    """A link to a folder that contains the project (``up -> ..``, ``up -> /``) is refused naming the link itself,
    without walking what is under it (a whole file system before reaching the project again)."""
    root = tmp_path / "proj"
    root.mkdir()
    (tmp_path / "a_sibling").mkdir()
    (tmp_path / "a_sibling" / "big.bin").write_bytes(b"x")
    (root / "up").symlink_to(tmp_path if target == "parent" else Path("/"), target_is_directory=True)
    with pytest.raises(jobs.JobsError, match=r"^up in .* is a link to .*, a folder that contains it"):
        jobs.upload_files(root)


def test_unlistable_folder_is_a_jobs_error(tmp_path, monkeypatch):
    root = tmp_path / "proj"
    (root / "locked").mkdir(parents=True)
    listdir = os.listdir

    def refuse(path):
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr(jobs.os, "listdir", refuse)
    with pytest.raises(jobs.JobsError, match=r"cannot list locked in .*proj to size the upload: .*Permission denied"):
        jobs.upload_files(root)
