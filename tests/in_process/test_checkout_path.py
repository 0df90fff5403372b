"""Tests that do not depend on where the checkout lives: a copy of this checkout in a folder other users cannot enter
(``mktemp -d``: mode 0700) under a path with spaces, then the same copy read-only, each running a few representative
tests and the command line from another working folder (≈ 1.5 minutes in all).

What a checkout's place must not decide, by kind:

- a process run as another user reads the project's modules (the sandbox's unprivileged harness): it gets a copy it
  can read, not the checkout;
- paths are found from the test's own file, never from the working folder (a relative ``examples/...``), and quoted
  where they reach a shell or a file URL (a space);
- tests write only to temporary folders: a spec's relative ``output_dir`` is overridden, and pytest's cache and
  Python's bytecode are off (``-p no:cacheprovider``, ``PYTHONDONTWRITEBYTECODE=1``), so nothing lands in the tree;
- data beside the checkout (``../shared/data``) is named by ``$GRPO_CLUSTER_SHARED_DATA`` for a checkout elsewhere
  (``tests/shared_data.py``).

The copy holds what ``git ls-files`` lists (tracked files and untracked ones not ignored), as they are in the working
tree now. Read-only means a read-only bind mount by bwrap (``bwrap --dev-bind / / --ro-bind COPY COPY``: even root
cannot write there); without bwrap, file modes (``chmod -R a-w``), which bind a user other than root only.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.shared_data import SHARED_DATA, SHARED_DATA_ENV

REPO = Path(__file__).resolve().parents[2]
#: Run inside the copy, each standing for a kind (module docstring).
TESTS = (
    "tests/unit/test_sandbox.py::test_sandbox_unprivileged_harness",  # another uid imports the sandbox's modules
    "tests/unit/test_import_layering.py",  # the tree read from the test's own path
    "tests/unit/test_named_paths.py",
    "tests/unit/test_refusals_leave_nothing.py",  # the command line on an example, from any working folder
    "tests/unit/test_own_task_rewards.py::test_own_task_example_validates",  # an example's relative output_dir
    "tests/in_process/test_local_job.py::test_every_step_trains_and_syncs_verified",  # the loop, writing to tmp only
)
ROWS = "".join(f'{{"question": "What is {i} + {i}?", "answer": "#### {2 * i}"}}\n' for i in range(8))


def _listed_files() -> list[str]:
    """The checkout's files as ``git ls-files`` lists them (tracked, and untracked but not ignored); skips the test
    without git or outside a git work tree."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the checkout is copied from `git ls-files`, which failed here: {exc}")
    return [name for name in out.decode().split("\0") if name and (REPO / name).is_file()]


def _tree(root: Path) -> set[str]:
    """Every file and folder under ``root``, relative."""
    return {path.relative_to(root).as_posix() for path in root.rglob("*")}


@pytest.fixture(scope="module")
def checkout():
    """A copy of this checkout at ``<mktemp -d>/a checkout with spaces/grpo cluster`` (the temporary folder mode 0700,
    as ``mktemp -d`` makes it), removed afterwards."""
    private = Path(tempfile.mkdtemp(prefix="checkout_path-"))
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    root = private / "a checkout with spaces" / "grpo cluster"
    try:
        for name in _listed_files():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
        yield root
    finally:
        for folder, _, _ in os.walk(private):  # writable again if a test without bwrap made it read-only
            os.chmod(folder, 0o700)
        shutil.rmtree(private, ignore_errors=True)


def _env(checkout: Path) -> dict[str, str]:
    """This environment for a run in the copy: its modules first on the path (not this checkout's), no bytecode
    written, the shared data named, and none of this pytest run's own variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(PYTHONPATH=str(checkout), PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    env[SHARED_DATA_ENV] = str(SHARED_DATA)
    return env


def _run(checkout: Path, args: list[str], cwd: Path, wrap: list[str], timeout: float = 300
         ) -> subprocess.CompletedProcess:
    return subprocess.run([*wrap, sys.executable, *args], cwd=cwd, env=_env(checkout), capture_output=True,
                          text=True, timeout=timeout)


def _check_in(checkout: Path, work: Path, tiny_model_dir: str, wrap: list[str]) -> None:
    """From ``work`` (another working folder): the copy's modules are the ones imported; the representative tests
    pass or skip; ``grpo-cluster validate`` of an example spec named by its absolute path (spaces in it) passes."""
    where = _run(checkout, ["-c", "import cluster, grpo, tests; print(cluster.__file__, grpo.__file__, "
                            "tests.__file__, sep='\\n')"], work, wrap)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(checkout)) for line in where.stdout.split("\n") if line), where.stdout
    done = _run(checkout, ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           *(str(checkout / test.split("::")[0]) + test[len(test.split("::")[0]):] for test in TESTS)],
                work, wrap)
    assert done.returncode == 0, f"tests in {checkout} failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert " passed" in done.stdout.splitlines()[-1], done.stdout[-2000:]
    data = work / "train.jsonl"
    data.write_text(ROWS)
    valid = _run(checkout, ["-m", "cluster.cli", "validate", str(checkout / "tests" / "tiny_cpu.yaml"),
                            "--set", f"model.path={tiny_model_dir}", "--set", f"data.train_path={data}",
                            "--set", f"data.test_path={data}", "--set", f"output_dir={work / 'out'}",
                            "--set", "metrics.port=null"], work, wrap)
    assert valid.returncode == 0, valid.stderr[-3000:]
    assert "valid: nothing was started or written" in valid.stdout, valid.stdout[-2000:]


def test_checkout_path_private_folder_with_spaces(checkout, tiny_model_dir, tmp_path):
    before = _tree(checkout)
    _check_in(checkout, tmp_path, tiny_model_dir, wrap=[])
    assert sorted(_tree(checkout) - before) == [], "files written into the checkout"


def _read_only(checkout: Path) -> list[str]:
    """The command prefix that runs with ``checkout`` read-only (module docstring); skips when there is none."""
    bwrap = shutil.which("bwrap")
    if bwrap is not None:
        probe = subprocess.run([bwrap, "--dev-bind", "/", "/", "--ro-bind", str(checkout), str(checkout), "true"],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return [bwrap, "--dev-bind", "/", "/", "--ro-bind", str(checkout), str(checkout)]
    if os.geteuid() == 0:
        pytest.skip("a read-only checkout needs bwrap's read-only bind here (root writes through file modes); "
                    "scripts/install_test_tools.sh installs bubblewrap")
    for folder, dirs, files in os.walk(checkout):
        for name in files:
            os.chmod(os.path.join(folder, name), 0o444)
        os.chmod(folder, 0o555)
    return []


def test_checkout_path_read_only(checkout, tiny_model_dir, tmp_path):
    wrap = _read_only(checkout)
    denied = subprocess.run([*wrap, sys.executable, "-c", f"open({str(checkout / 'probe')!r}, 'w')"],
                            capture_output=True, text=True, timeout=60)
    assert denied.returncode != 0 and ("Read-only file system" in denied.stderr or "Permission" in denied.stderr)
    _check_in(checkout, tmp_path, tiny_model_dir, wrap)
