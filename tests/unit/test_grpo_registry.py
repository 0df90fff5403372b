"""Unit tests for grpo.registry and the package-wide rules of grpo/ (no Ray / torch.distributed, small modules)."""

import ast
from pathlib import Path

import pytest

import grpo
from grpo.registry import Registry

GRPO_DIR = Path(grpo.__file__).resolve().parent
MODULES = sorted(GRPO_DIR.rglob("*.py"))


def test_registry_register_lookup_and_duplicates():
    reg = Registry("widget")

    @reg.register("a")
    def a():
        return 1

    assert reg["a"] is a and reg.lookup("a")() == 1
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(lambda: 2)
    with pytest.raises(ValueError, match="already registered"):
        reg["a"] = lambda: 2
    with pytest.raises(ValueError, match="already registered"):
        reg.update({"a": lambda: 2})
    with pytest.raises(ValueError, match=r"unknown widget 'b'; expected one of \['a'\]"):
        reg.lookup("b")
    with pytest.raises(ValueError, match="non-empty str"):
        reg[""] = a
    assert reg.setdefault("a", lambda: 3) is a
    reg.update(b=lambda: 4)
    assert sorted(reg) == ["a", "b"]


def test_registry_lazy_entries_import_on_first_lookup():
    import sys

    reg = Registry("widget")
    reg.register_lazy("dumps", "json.tool:main")
    reg.register_lazy("gone", "no_such_module_here:f")
    assert "dumps" in reg and reg.targets == {"dumps": "json.tool:main", "gone": "no_such_module_here:f"}
    sys.modules.pop("json.tool", None)
    assert reg["dumps"] is __import__("json.tool").tool.main and reg.get("dumps") is reg["dumps"]
    with pytest.raises(ImportError, match="widget 'gone' lives in no_such_module_here:f, which cannot be loaded"):
        reg.lookup("gone")
    with pytest.raises(ValueError, match="already registered"):
        reg.register_lazy("dumps", "json:dumps")
    with pytest.raises(ValueError, match="widget 'x': expected a target 'package.module:attribute'"):
        reg.register_lazy("x", "json.dumps")
    assert "x" not in reg


def test_grpo_imports_neither_ray_nor_torch_distributed():
    for path in MODULES:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not (name == "ray" or name.startswith("ray.")), f"{path} imports {name}"
                assert not name.startswith("torch.distributed"), f"{path} imports {name}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(GRPO_DIR)))
def test_modules_are_under_500_lines(path):
    assert len(path.read_text().splitlines()) < 500


def test_public_names_are_exported():
    for name in grpo.__all__:
        assert hasattr(grpo, name), name
