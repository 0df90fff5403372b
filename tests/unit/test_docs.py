"""The docs are tested where they contain specs or commands (README.md and docs/*.md).

- Every ```yaml block is a job spec, or a fragment of one, and must validate: a block with ``output_dir`` and
  ``total_steps`` is loaded as it is; a fragment is merged into a small jsonl spec (or, when it sets ``data``, replaces
  its data section) and loaded. Reward files a block names (``"reward.py:correct"``) are looked up in the folder an
  ``<!-- spec dir: PATH -->`` comment above the block names (relative to the repository). A block that is not a job
  spec is marked ``<!-- not a spec -->`` on the line above its fence.
- Every ``grpo-cluster ...`` command in a shell block or an inline code span must name a real subcommand, and every
  ``--flag`` in it must be one of that subcommand's options (what ``grpo-cluster COMMAND --help`` lists). Bracketed
  synopsis parts (``[--set k=v ...]``) are checked the same way.
"""

from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from cluster.cli import build_parser
from cluster.spec import SpecError, load_spec_text
from grpo.rewards import REWARD_FUNCTIONS

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FRAGMENT_BASE = {"output_dir": "runs/docs", "total_steps": 10,
                 "data": {"train_path": "train.jsonl", "test_path": "test.jsonl"}}
FENCE = re.compile(r"^```(\w*)\s*$")
SPEC_DIR = re.compile(r"<!--\s*spec dir:\s*(\S+)\s*-->")


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page: its language, text, first line (1-based) and the line above its fence."""

    page: Path
    language: str
    text: str
    line: int
    above: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, start, language = [], None, ""
    for number, line in enumerate(lines, start=1):
        match = FENCE.match(line)
        if match and start is None:
            start, language = number, match.group(1)
        elif line.strip() == "```" and start is not None:
            above = lines[start - 2] if start >= 2 else ""
            out.append(Block(page, language, "\n".join(lines[start:number - 1]), start + 1, above))
            start = None
    return out


YAML_BLOCKS = [b for page in PAGES for b in blocks(page) if b.language == "yaml" and "not a spec" not in b.above]


def _merge(base: dict, fragment: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in fragment.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "data":
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=str)
def test_every_yaml_block_in_the_docs_is_a_valid_spec(block, monkeypatch):
    for name in re.findall(r"\$\{(\w+)\}", block.text):  # a ${VAR} the reader sets in their environment
        monkeypatch.setenv(name, "set-by-the-reader")
    data = yaml.safe_load(block.text) or {}
    assert isinstance(data, dict), f"{block}: a yaml block that is not a mapping; mark it <!-- not a spec -->"
    whole = "output_dir" in data and "total_steps" in data
    spec = data if whole else _merge(FRAGMENT_BASE, data)
    spec_dir = SPEC_DIR.search(block.above)
    base_dir = REPO / spec_dir.group(1) if spec_dir else REPO
    before = set(REWARD_FUNCTIONS)
    try:
        load_spec_text(yaml.safe_dump(spec), source=str(block), base_dir=base_dir)
    except SpecError as exc:
        pytest.fail(f"{block}: the spec {'block' if whole else 'fragment'} does not validate:\n{exc}")
    finally:  # a block's reward endpoints are registered when it validates: not for the rest of the session
        for name in set(REWARD_FUNCTIONS) - before:
            REWARD_FUNCTIONS.pop(name)


def test_the_docs_hold_spec_blocks():
    """The parametrised test above must see the docs' specs (a renamed fence would skip them all)."""
    assert len(YAML_BLOCKS) >= 10 and any("coming_from" in str(b) for b in YAML_BLOCKS)


_COMMAND = re.compile(r"(?:^|[\s`(])(?:\.venv/bin/)?grpo-cluster(?![-\w:.])((?:\s+[^`\n#|;&]*)?)")
_SHELL = {"bash", "sh", "shell", "console", ""}


def commands(page: Path) -> list[tuple[str, str]]:
    """(where, command text) of every ``grpo-cluster ...`` in the page's shell blocks (continuation lines joined,
    comments dropped) and inline code spans."""
    out = []
    for block in blocks(page):
        if block.language not in _SHELL:
            continue
        text = re.sub(r"\\\n\s*", " ", block.text)
        for offset, line in enumerate(text.splitlines()):
            code = line.split(" #", 1)[0]
            for match in _COMMAND.finditer(code):
                out.append((f"{block}+{offset}", match.group(1)))
    prose = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for span in re.findall(r"`([^`\n]*grpo-cluster[^`\n]*)`", prose):
        for match in _COMMAND.finditer(" " + span):
            out.append((f"{page.relative_to(REPO)} `{span}`", match.group(1)))
    return out


COMMANDS = [(where, text) for page in PAGES for where, text in commands(page)]


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return parser, action.choices


@pytest.mark.parametrize("where, text", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_grpo_cluster_command_in_the_docs_matches_its_help(where, text):
    parser, subcommands = _subparsers()
    try:
        tokens = shlex.split(text.replace("[", " ").replace("]", " ").replace("|", " "))
    except ValueError:
        tokens = text.replace("[", " ").replace("]", " ").split()
    words = [t for t in tokens if t not in ("...", "…")]
    if not words or words[0].startswith("--"):  # `grpo-cluster --version`, `grpo-cluster --help`, or the bare name
        top = {s for a in parser._actions for s in a.option_strings}
        assert all(w.split("=")[0] in top for w in words if w.startswith("--")), (where, text)
        return
    if words[0] not in subcommands:
        if words[0][:1].isupper() or not words[0].isidentifier():  # prose: "grpo-cluster COMMAND --help"
            return
        pytest.fail(f"{where}: `grpo-cluster {words[0]}` is not a command; commands: {', '.join(subcommands)}")
    sub = subcommands[words[0]]
    known = {s for a in sub._actions for s in a.option_strings}
    unknown = [w.split("=")[0] for w in words[1:] if w.startswith("--") and w.split("=")[0] not in known]
    assert not unknown, f"{where}: grpo-cluster {words[0]} has no {unknown}; it has {sorted(known)}"


def test_the_docs_show_commands_of_every_kind():
    shown = {shlex.split(t)[0] for _, t in COMMANDS if t.strip() and not t.strip().startswith("-")}
    assert {"run", "validate", "eval", "plot", "submit", "scale", "spec"} <= shown, shown


_LINK = re.compile(r"\]\(([^)#\s]*)(#[^)\s]*)?\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_between_the_docs_lead_somewhere(page):
    """Every relative link names a file of the repository, and a ``#fragment`` a heading of that page."""
    prose = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target, fragment in _LINK.findall(prose):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(target)
        elif fragment and path.suffix == ".md" and fragment[1:] not in _anchors(path):
            broken.append(target + fragment)
    assert not broken, f"{page.relative_to(REPO)}: links to nothing: {broken}"
