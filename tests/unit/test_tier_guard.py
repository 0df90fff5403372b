"""The tier guard (tests/tier_guard.py): a pytest run over a whole tests tree fails, naming the tier, when a tier
collects nothing; pytest runs in a subprocess on a temporary tree wired like this repository's tests/conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO

CONFTEST = textwrap.dedent("""
    from pathlib import Path

    import pytest

    from tests.tier_guard import EmptyTiersReport, check_tiers


    def pytest_configure(config):
        config.pluginmanager.register(EmptyTiersReport(), "tier_guard_report")


    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(config, items):
        check_tiers(config, items, Path(__file__).parent)
""")
PASSING = "def test_ok():\n    pass\n"


def make_tree(root: Path, tiers: dict[str, dict[str, str]]) -> Path:
    """``root/suite`` with a conftest like tests/conftest.py and ``{tier: {file name: text}}`` below it."""
    suite = root / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "data").mkdir()  # a folder without Python files is no tier
    (suite / "data" / "table.json").write_text("{}")
    for tier, files in tiers.items():
        (suite / tier).mkdir()
        for name, text in files.items():
            (suite / tier / name).write_text(text)
    return suite


def run_pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(cwd),
                           *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_every_tier_collected_passes(tmp_path):
    make_tree(tmp_path, {"unit": {"test_a.py": PASSING}, "distributed": {"test_b.py": PASSING}})
    result = run_pytest(tmp_path, "suite")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


@pytest.mark.parametrize("name", ["dist", "build", "venv"])
def test_tier_skipped_by_norecursedirs_fails_the_run(tmp_path, name):
    make_tree(tmp_path, {"unit": {"test_a.py": PASSING}, name: {"test_b.py": PASSING}})
    result = run_pytest(tmp_path, "suite")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert f"test tier {tmp_path / 'suite' / name} collected no tests" in result.stderr
    assert f"norecursedirs skips folders named '{name}'" in result.stderr
    assert "passed" not in result.stdout  # stopped at collection: nothing ran


def test_plain_pytest_through_testpaths_is_a_whole_suite_run(tmp_path):
    make_tree(tmp_path, {"unit": {"test_a.py": PASSING}, "dist": {"test_b.py": PASSING}})
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["suite"]\n')
    result = run_pytest(tmp_path)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert f"test tier {tmp_path / 'suite' / 'dist'} collected no tests" in result.stderr


def test_tier_without_tests_fails_the_run_naming_each_empty_tier(tmp_path):
    make_tree(tmp_path, {"unit": {"test_a.py": PASSING}, "ray": {"helpers.py": "X = 1\n"},
                         "gpu": {"test_c.py": "def helper():\n    pass\n"}})
    result = run_pytest(tmp_path, "suite")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    for tier in ("ray", "gpu"):
        assert f"test tier {tmp_path / 'suite' / tier} collected no tests: no test was collected" in result.stderr
    assert "tier " + str(tmp_path / "suite" / "unit") not in result.stderr


def test_deselected_and_skipped_tests_count_as_collected(tmp_path):
    skipped = "import pytest\n\n@pytest.mark.skip(reason='no GPU')\ndef test_gpu():\n    pass\n"
    make_tree(tmp_path, {"unit": {"test_a.py": PASSING}, "gpu": {"test_c.py": skipped}})
    result = run_pytest(tmp_path, "suite", "-k", "not test_ok")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 skipped, 1 deselected" in result.stdout


def test_narrowed_runs_are_not_checked_but_a_named_empty_tier_is(tmp_path):
    make_tree(tmp_path, {"unit": {"test_a.py": PASSING}, "dist": {"test_b.py": PASSING},
                         "e2e": {"conftest.py": "\n"}})
    assert run_pytest(tmp_path, "suite/unit/test_a.py").returncode == 0
    assert run_pytest(tmp_path, "suite/unit").returncode == 0
    named = run_pytest(tmp_path, "suite/e2e")
    assert named.returncode == pytest.ExitCode.USAGE_ERROR and "tier " + str(tmp_path / "suite" / "e2e") in named.stderr


def test_this_repository_tiers_are_discovered():
    from tests.tier_guard import discover_tiers

    names = [p.name for p in discover_tiers(REPO / "tests")]
    assert {"unit", "distributed", "ray", "e2e", "gpu"} <= set(names) and "data" not in names


@pytest.mark.parametrize("ignore", [["--ignore=suite/e2e"], ["--ignore", "suite/e2e/test_e.py"],
                                    ["--ignore-glob=*e2e*"], ["--ignore-glob=suite/e2e/*.py"]])
def test_a_tier_left_out_with_ignore_is_not_reported(tmp_path, ignore):
    make_tree(tmp_path, {"unit": {"test_a.py": PASSING}, "e2e": {"test_e.py": PASSING}, "dist": {"test_b.py": PASSING}})
    result = run_pytest(tmp_path, "suite", *ignore)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "tier " + str(tmp_path / "suite" / "e2e") not in result.stderr  # asked to leave it out
    assert f"test tier {tmp_path / 'suite' / 'dist'} collected no tests" in result.stderr  # still guarded
    (tmp_path / "suite" / "dist").rename(tmp_path / "suite" / "distributed")
    result = run_pytest(tmp_path, "suite", *ignore)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_a_tier_skipped_whole_at_collection_counts_as_collected(tmp_path):
    """GPU-only test files skip at import when an optional dependency is missing (``pytest.importorskip``); such a
    tier is present and reported as skipped, not empty."""
    importorskip = ("import pytest\n\npytest.importorskip('no_such_module_for_this_test')\n\n\n"
                    "def test_gpu():\n    pass\n")
    make_tree(tmp_path, {"unit": {"test_a.py": PASSING}, "gpu": {"test_c.py": importorskip}})
    result = run_pytest(tmp_path, "suite")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 1 skipped" in result.stdout
    (tmp_path / "other").mkdir()
    make_tree(tmp_path / "other", {"unit": {"test_a.py": PASSING}, "gpu": {"helpers.py": "X = 1\n"}})
    still_empty = run_pytest(tmp_path / "other", "suite")
    assert still_empty.returncode == pytest.ExitCode.USAGE_ERROR, still_empty.stdout + still_empty.stderr


def test_an_import_error_is_reported_as_itself_not_as_an_empty_tier(tmp_path):
    broken = "import no_such_module_for_this_test\n\n\ndef test_x():\n    pass\n"
    make_tree(tmp_path, {"unit": {"test_a.py": PASSING}, "ray": {"test_r.py": broken}})
    result = run_pytest(tmp_path, "suite")
    assert result.returncode == pytest.ExitCode.INTERRUPTED, result.stdout + result.stderr
    assert "ModuleNotFoundError: No module named 'no_such_module_for_this_test'" in result.stdout
    assert "collected no tests" not in result.stdout + result.stderr


def test_under_xdist_the_run_fails_on_a_tier_guard_item_naming_the_empty_tier(tmp_path):
    """With ``-n 2`` the check runs in the workers: the run fails on ``::tier-guard``, whose failure names the empty
    tier (a usage error there would crash the workers without the message); also with ``-m`` deselecting
    everything else. A run whose tiers all collect passes as without xdist."""
    pytest.importorskip("xdist")
    make_tree(tmp_path, {"unit": {"test_a.py": PASSING}, "ray": {"helpers.py": "X = 1\n"}})
    for args in ([], ["-m", "engine"]):
        result = run_pytest(tmp_path, "suite", "-n", "2", *args)
        assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout + result.stderr
        assert "FAILED ::tier-guard" in result.stdout and "INTERNALERROR" not in result.stdout + result.stderr
        assert f"test tier {tmp_path / 'suite' / 'ray'} collected no tests: no test was collected" in result.stdout
    (tmp_path / "suite" / "ray" / "test_r.py").write_text(PASSING)
    result = run_pytest(tmp_path, "suite", "-n", "2")
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout + result.stderr
