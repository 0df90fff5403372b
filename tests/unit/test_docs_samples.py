"""Command output quoted in the docs is the command's output now: ``docs/getting_started.md``'s sample of
``grpo-cluster validate examples/learn_cpu.yaml`` is compared, line for line, with what the command prints (run from
a temporary working folder, with this checkout's paths written relative to it and the model cache as ``~``).

When it fails, regenerate the sample rather than editing it by hand: from an empty folder,
``PYTHONPATH=REPO grpo-cluster validate REPO/examples/learn_cpu.yaml``, with ``REPO/`` and the cache folder shortened.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GETTING_STARTED = REPO / "docs" / "getting_started.md"
INTRO = "`validate` prints what would run, e.g. for `examples/learn_cpu.yaml`:\n\n```\n"


def _quoted_validate_output() -> list[str]:
    text = GETTING_STARTED.read_text()
    assert INTRO in text, f"{GETTING_STARTED}: the validate sample's introduction changed; update this test"
    start = text.index(INTRO) + len(INTRO)
    return text[start:text.index("```\n", start)].splitlines()


def test_getting_started_validate_sample_is_what_validate_prints(tmp_path, monkeypatch, capsys):
    from cluster.cli import main
    from cluster.data.models import default_cache_dir

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(REPO / "examples" / "learn_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    for long, short in ((f"{tmp_path}/", ""), (f"{REPO}/", ""), (str(default_cache_dir()), "~/.cache/grpo-cluster")):
        out = out.replace(long, short)
    assert _quoted_validate_output() == out.splitlines(), (
        f"{GETTING_STARTED}: the validate sample differs from the command's output (module docstring: regenerate it):"
        f"\n{out}")
