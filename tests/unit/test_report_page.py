"""``grpo-cluster report RUN [--out FILE]`` without a browser (the page in headless Chromium:
tests/in_process/test_report_samples.py): the page of a stand-in run is one self-contained file whose samples are
data, never markup; and bad input — a folder that is not a run, a run still being written, a torn ``samples.jsonl``
line, a bad ``--out`` — gives one line each, never a traceback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.driver import GRPOJob
from cluster.spec import load_spec_text
from contract.messages import GroupResult
from tests.job_runs import run_to_end
from tests.stand_ins import StandInFleet, StandInTrainer

HOSTILE = '</script><img src=x onerror="alert(1)">&amp;'


class WritesMarkup(StandInFleet):
    """Completions whose text is markup (a page that pasted it in would run it)."""

    def group(self, request) -> GroupResult:
        group = super().group(request)
        group.texts = [HOSTILE + text for text in group.texts]
        return group


def _spec(tmp_path: Path, model: str, total_steps: int = 2):
    rows = "".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                   for i in range(8))
    (tmp_path / "train.jsonl").write_text(rows)
    return load_spec_text(
        f"name: reported\noutput_dir: {tmp_path / 'out'}\ntotal_steps: {total_steps}\nmodel: {{path: {model}}}\n"
        f"data: {{train_path: {tmp_path / 'train.jsonl'}, test_path: {tmp_path / 'train.jsonl'}}}\n"
        f"rollout: {{prompts_per_step: 2, group_size: 2}}\neval: {{every_steps: 1, limit: 2}}\n"
        f"metrics: {{port: null}}\ncheckpoint: {{every_steps: 0, save_final: false}}\n")


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    spec = _spec(tmp_path_factory.mktemp("report_page"), tiny_model_dir)
    run_to_end(GRPOJob(spec, fleet=WritesMarkup(), trainer=StandInTrainer(), progress=False))
    return Path(spec.output_dir)


def _report(capsys, *args: str) -> tuple[int, str, list[str]]:
    """``grpo-cluster report ARGS``: (exit code, stdout, stderr lines)."""
    code = main(["report", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.splitlines()


def test_report_page_is_one_self_contained_file_whose_samples_are_data(run_dir, capsys, tmp_path):
    code, out, err = _report(capsys, run_dir, "--out", tmp_path / "page.html")
    assert (code, out.strip(), err) == (0, f"wrote {tmp_path / 'page.html'}", [])
    page = (tmp_path / "page.html").read_text()
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=[\"'](https?:)?//", page)  # nothing fetched
    assert "Plotly.newPlot" in page and page.count('class="plotly-graph-div"') >= 5
    assert HOSTILE not in page and "<img src=x" not in page and "<|im_start|>" not in page
    data = re.search(r'<script type="application/json" id="samples-data">(.*?)</script>', page, re.S).group(1)
    samples = json.loads(data)
    assert sorted(samples["train"]) == ["1", "2"] and sorted(samples["eval"]) == ["0", "1", "2"]
    first = samples["train"]["1"][0]["completions"][0]
    assert first["text"].startswith(HOSTILE) and samples["train"]["1"][0]["prompt"].startswith("<|im_start|>")
    assert "<td>0</td>" in page  # the eval table's first row, the starting weights' evaluation


def test_report_default_page_is_in_the_run_folder_and_replaces_an_earlier_one(run_dir, capsys):
    for _ in range(2):
        code, out, err = _report(capsys, run_dir)
        assert (code, out.strip(), err) == (0, f"wrote {run_dir / 'report.html'}", [])
    assert not list(run_dir.glob(".report.html.*"))  # written atomically: no partial file left


@pytest.mark.parametrize("case", ["missing", "a file", "no metrics", "bad line", "no step"])
def test_report_of_a_folder_that_is_not_a_run_is_one_line(case, tmp_path, capsys):
    target = tmp_path / "run"
    if case == "a file":
        target.write_text("hello")
    elif case != "missing":
        target.mkdir()
        lines = {"no metrics": None, "bad line": '{"step": 1}\nnot json\n{"step": 2}\n', "no step": '{"a": 1}\n'}
        if lines[case] is not None:
            (target / "metrics.jsonl").write_text(lines[case])
    code, out, err = _report(capsys, target)
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith("grpo-cluster report: ") and str(target) in err[0]
    assert not (tmp_path / "run" / "report.html").exists()


@pytest.mark.parametrize("name,content,why", [
    ("page.png", None, "expected an .html file name"), ("folder.html/", None, "is a folder"),
    ("notes.html", "my notes, not a page", "not an HTML page"), ("missing/page.html", None, "does not exist")])
def test_report_refuses_a_bad_out_in_one_line(run_dir, tmp_path, capsys, name, content, why):
    out = tmp_path / name
    if name.endswith("/"):
        out.mkdir()
    if content is not None:
        out.write_text(content)
    code, stdout, err = _report(capsys, run_dir, "--out", out)
    assert code == 2 and stdout == "" and len(err) == 1 and why in err[0], err
    if content is not None:
        assert out.read_text() == content


def test_report_of_a_run_still_being_written_shows_what_is_there(tiny_model_dir, tmp_path, capsys):
    spec = _spec(tmp_path, tiny_model_dir, total_steps=2)
    run_to_end(GRPOJob(spec, fleet=StandInFleet(), trainer=StandInTrainer(), progress=False))
    capsys.readouterr()
    run = Path(spec.output_dir)
    spec_yaml = (run / "spec.yaml").read_text().replace("total_steps: 2", "total_steps: 5")
    (run / "spec.yaml").write_text(spec_yaml)  # as if steps 3..5 were still to come
    for name in ("summary.json", "summary.txt"):
        (run / name).unlink()  # written when a run ends
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/mean": 0.')  # the job is writing its next line
    lines = (run / "samples.jsonl").read_text().splitlines(keepends=True)
    (run / "samples.jsonl").write_text("".join(lines[:3]) + lines[3][:25] + "\n" + "".join(lines[4:]) + '{"st')
    code, out, err = _report(capsys, run)
    assert code == 0 and out.strip() == f"wrote {run / 'report.html'}"
    assert all(line.startswith("grpo-cluster report: note: ") for line in err) and len(err) == 3, err
    assert "partial last line" in err[0] and "still being written" in err[2] and "last step is 2 of total_steps 5" \
        in err[2]
    assert "left out 2 line(s) that are not sample records (line 4, " in err[1]
    page = (run / "report.html").read_text()
    assert "still being written" in page and "Traceback" not in "".join(err)


def test_report_of_a_resumed_run_does_not_take_an_earlier_summary_for_its_end(tiny_model_dir, tmp_path, capsys):
    """A run that ended (summary.json) and was resumed with a larger total_steps: the summary of its earlier end is
    named as such, and the run is still being written."""
    spec = _spec(tmp_path, tiny_model_dir, total_steps=2)
    run_to_end(GRPOJob(spec, fleet=StandInFleet(), trainer=StandInTrainer(), progress=False))
    capsys.readouterr()
    run = Path(spec.output_dir)
    (run / "spec.yaml").write_text((run / "spec.yaml").read_text().replace("total_steps: 2", "total_steps: 5"))
    code, out, err = _report(capsys, run)
    assert code == 0 and len(err) == 2, err
    assert "summary.json: describes an earlier end of this run" in err[0]
    assert "still being written" in err[1] and "last step is 2 of total_steps 5" in err[1]


def test_report_shows_goodput_health_and_the_summary_when_the_run_has_them(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "reward/mean": 0.1 * s, "time/rollout_busy_s": 30.0 + s, "time/train_busy_s": 12.0,
             "goodput/tokens_per_s": 40.0 + s, "health/repetition": float(s == 2), "health/warnings": float(s == 2),
             "timing/step_s": 50.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.txt").write_text("held-out accuracy 7.3 % -> 26.3 %: improved\n")
    (run / "summary.json").write_text("{}")
    code, out, err = _report(capsys, run)
    assert code == 0 and err == [f"grpo-cluster report: note: {run / 'samples.jsonl'}: not found (a run without "
                                 f"metrics.samples_per_step, or from before it); the page has no samples"]
    page = (run / "report.html").read_text().replace("\\u002f", "/")  # plotly's JSON writes / as \u002f
    for text in ("Busy time by pool", "time/rollout_busy_s", "time/train_busy_s", "Goodput (goodput/tokens_per_s)",
                 "health: repetition", "held-out accuracy 7.3 % -&gt; 26.3 %: improved"):
        assert text in page, text
    assert "health: warnings" not in page  # a count of detectors, not a detector


def test_report_of_samples_with_numbers_json_has_not_shows_them_as_null(run_dir, tmp_path, capsys):
    """A samples.jsonl written by hand or by another program may hold NaN, Infinity or 1e400 (Python's json reads
    them; the job writes null): the page is still written, those numbers as null."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    with (run / "samples.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 2, "group_id": 9, "reward": NaN, "completions": [{"index": 0, '
                '"text": "x", "reward": Infinity, "advantage": -Infinity, "length": 1e400}]}\n')
    code, out, err = _report(capsys, run, "--out", tmp_path / "page.html")
    assert (code, out.strip(), err) == (0, f"wrote {tmp_path / 'page.html'}", [])
    page = (tmp_path / "page.html").read_text()
    data = re.search(r'<script type="application/json" id="samples-data">(.*?)</script>', page, re.S).group(1)
    added = [g for g in json.loads(data)["train"]["2"] if g.get("group_id") == 9][0]
    assert added["reward"] is None and added["completions"][0] == {"index": 0, "text": "x", "reward": None,
                                                                   "advantage": None, "length": None}


def test_report_that_cannot_be_written_where_asked_is_one_line_naming_the_page(run_dir, tmp_path, capsys,
                                                                              monkeypatch):
    """A read-only folder (or a full disk): one line naming the page and --out, no partial file left."""
    import errno
    import os

    def read_only(src, dst):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dst))

    monkeypatch.setattr(os, "replace", read_only)
    code, out, err = _report(capsys, run_dir, "--out", tmp_path / "page.html")
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0] == (f"grpo-cluster report: cannot write the page {tmp_path / 'page.html'}: Permission denied (in "
                      f"{tmp_path}); choose a writable place with --out FILE.html")
    assert not list(tmp_path.glob(".page.html.*")) and not (tmp_path / "page.html").exists()
