"""Issue #27, general data: a prompt column holding text or chat messages, extra columns kept for the rewards, the
system prompt and a chat-template override, hub dataset ids (the offline error naming the field, and the cached path),
and the data section's fields."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cluster.data import DataError, Example, build_chat_prompt, chat_prompt_ids, load_jsonl_examples
from cluster.data.sources import load_examples
from cluster.spec import SpecError, load_spec_text

REPO = Path(__file__).resolve().parents[2]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 + 5?"}]


def write_rows(tmp_path: Path, rows: list, name: str = "rows.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def data_spec(tmp_path: Path, data: str, rest: str = ""):
    return load_spec_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: 1\ndata:\n{textwrap.indent(data, '  ')}"
                          f"{rest}", base_dir=tmp_path)


def test_own_task_prompt_column_text_or_messages_and_extra_columns(tmp_path):
    path = write_rows(tmp_path, [{"prompt": "What is 2 + 2?", "answer": "4", "difficulty": 1, "tags": ["easy"]},
                                 {"prompt": CHAT, "answer": 12, "difficulty": 2}])
    spec = data_spec(tmp_path, f"train_path: {path}\nprompt_field: prompt\n", "algorithm: {rewards: {format: 1.0}}\n")
    (text, chat), bad = load_examples(spec.data)
    assert bad == 0
    assert (text.prompt, text.question, text.columns) == ("What is 2 + 2?", "What is 2 + 2?",
                                                          {"answer": "4", "difficulty": 1, "tags": ["easy"]})
    assert chat.prompt == CHAT and chat.question == "What is 7 + 5?" and chat.prompt_as_given == CHAT
    assert (chat.answer, chat.reference, chat.columns["difficulty"]) == ("12", "12", 2)  # a number answer as text


@pytest.mark.parametrize(("prompt", "reason"), [
    ([], "field 'prompt': an empty list of chat messages"),
    ([{"role": "user"}], "field 'prompt': message 0: expected {'role': str, 'content': str}"),
    ([{"role": "narrator", "content": "x"}], "field 'prompt': message 0: role 'narrator', expected one of"),
    ([{"role": "system", "content": "x"}], "field 'prompt': expected at least one non-empty 'user' message"),
    ({"text": "x"}, "field 'prompt': expected a string or a list of {role, content} chat messages, got dict"),
    ("  ", "field 'prompt' is empty"),
])
def test_own_task_unusable_prompts_are_refused_with_file_and_line(tmp_path, prompt, reason):
    path = write_rows(tmp_path, [{"prompt": "ok?"}, {"prompt": prompt}])
    with pytest.raises(DataError) as info:
        load_jsonl_examples(path, prompt_field="prompt")
    assert str(info.value).startswith(f"{path}:2: {reason}")
    assert "1 of 2 rows are refused; set data.on_bad_row: skip" in str(info.value)


def test_own_task_missing_prompt_column_suggests_the_setting_and_lists_the_keys(tmp_path):
    path = write_rows(tmp_path, [{"problem": "P?", "solution": "1"}])
    spec = data_spec(tmp_path, f"train_path: {path}\n")
    with pytest.raises(DataError) as info:
        load_examples(spec.data)
    assert str(info.value) == (
        f"data.train_path: {path}:1: no prompt column 'question' (data.prompt_field (unset, so data.question_field "
        f"'question')); the row has keys ['problem', 'solution']: set data.prompt_field: problem (all 1 rows are "
        f"refused, so data.on_bad_row: skip would drop every one: fix the data or the data.* setting named above)")


def test_own_task_chat_prompt_gets_the_system_prompt_and_suffix():
    text = Example(0, "Q?", prompt="Q?")
    assert build_chat_prompt(text, "Sys.", " Go.") == [{"role": "system", "content": "Sys."},
                                                      {"role": "user", "content": "Q? Go."}]
    chat = Example(1, "What is 7 + 5?", prompt=CHAT)
    assert build_chat_prompt(chat, "Ignored: the row has its own.", "!") == [
        CHAT[0], {"role": "user", "content": "What is 7 + 5?!"}]
    bare = Example(2, "Hi", prompt=[{"role": "user", "content": "Hi"}])
    assert build_chat_prompt(bare, "Sys.", "") == [{"role": "system", "content": "Sys."},
                                                  {"role": "user", "content": "Hi"}]
    assert CHAT[1]["content"] == "What is 7 + 5?"  # the row's messages are not changed


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_own_task_chat_template_override_string_or_file(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from cluster.loop.setup import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = write_rows(tmp_path, [{"prompt": CHAT, "answer": "12"}])
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    for value in (json.dumps(TEMPLATE), "template.jinja"):
        spec = data_spec(tmp_path, f"train_path: {path}\nprompt_field: prompt\nchat_template: {value}\n",
                         "algorithm: {rewards: {format: 1.0}}\n")
        prompts = load_prompts(spec.data, tokenizer, spec.algorithm.rewards)
        assert tokenizer.decode(prompts.ids[0]) == "[system] Be brief.\n[user] What is 7 + 5?\n[assistant] "
    default = chat_prompt_ids(tokenizer, [Example(0, "What is 7 + 5?", prompt=CHAT)], None)
    assert tokenizer.decode(default[0]).startswith("<|im_start|>system")  # the tokenizer's own without the override
    bad = data_spec(tmp_path, f"train_path: {path}\nprompt_field: prompt\nchat_template: '{{% if %}}'\n")
    with pytest.raises(DataError, match=r"^data.chat_template: cannot render the prompts of .*TemplateSyntaxError"):
        load_prompts(bad.data, tokenizer)
    missing = data_spec(tmp_path, f"train_path: {path}\nprompt_field: prompt\nchat_template: nope.jinja\n")
    with pytest.raises(DataError, match=r"^data.chat_template: 'nope.jinja' is neither a Jinja template"):
        load_prompts(missing.data, tokenizer)


@pytest.mark.parametrize(("data", "field", "message"), [
    ("train_path: t.jsonl\nprompt_field: prompt\nquestion_field: problem\n", "data.question_field",
     "prompt_field 'prompt' names the prompt column"),
    ("source: hf_hub\n", "data.hub.name", "required with data.source 'hf_hub'"),
    ("source: hf_hub\nhub: {name: org/x}\ntrain_path: t.jsonl\n", "data.train_path",
     "not used with data.source 'hf_hub' (its splits are data.hub.split and data.hub.test_split)"),
    ("train_path: t.jsonl\nhub: {name: org/x}\n", "data.hub.name", "used only with data.source 'hf_hub'"),
])
def test_own_task_data_section_conflicts_name_the_field(tmp_path, data, field, message):
    with pytest.raises(SpecError, match=re.escape(f"{field}: {message}")):
        data_spec(tmp_path, data)


def test_own_task_existing_specs_validate_unchanged():
    from cluster.spec import load_spec

    paths = [*sorted((REPO / "examples").glob("*.yaml")), *sorted((REPO / "examples").glob("*/spec.yaml")),
             *sorted((REPO / "deploy" / "k8s").glob("**/spec.yaml"))]
    assert len(paths) >= 8
    for path in paths:
        spec = load_spec(path)
        assert spec.data.prompt_column == (spec.data.prompt_field or spec.data.question_field)


HUB_SCRIPT = """
import json, os, shutil, sys
from cluster.data import DataError
from cluster.data.sources import load_examples
from cluster.spec import load_spec_text
import datasets

root = sys.argv[1]
def spec(hub):
    return load_spec_text("output_dir: out\\ntotal_steps: 1\\ndata:\\n  source: hf_hub\\n  prompt_field: prompt\\n"
                          f"  hub: {hub}\\nalgorithm: {{rewards: {{format: 1.0}}}}\\n").data
out = {}
try:
    load_examples(spec("{name: own-task-org/tiny, config: main}"))
except DataError as exc:
    out["uncached"] = str(exc)
folder = os.path.join(root, "tiny")  # a dataset saved locally: a folder of data files
os.makedirs(folder)
for split, rows in (("train", 3), ("test", 2)):
    with open(os.path.join(folder, f"{split}.jsonl"), "w") as fh:
        for i in range(rows):
            fh.write(json.dumps({"prompt": f"{split} {i}?", "answer": str(i), "level": i}) + "\\n")
local = load_examples(spec("{name: %s, test_split: test}" % folder), "held_out")[0]
out["local"] = [[e.prompt, e.columns] for e in local]
cache = datasets.config.HF_DATASETS_CACHE  # what a download of own-task-org/tiny would have left there
shutil.copytree(os.path.join(cache, "tiny"), os.path.join(cache, "own-task-org___tiny"))
cached = load_examples(spec("{name: own-task-org/tiny, test_split: test}"))[0]
out["cached"] = [[e.prompt, e.columns] for e in cached]
try:
    load_examples(spec("{name: own-task-org/tiny, split: nope}"))
except DataError as exc:
    out["bad_split"] = str(exc)
print(json.dumps(out))
"""


def test_own_task_hub_dataset_offline_error_and_cached_copy(tmp_path):
    """This machine has no network: an uncached hub id fails naming data.hub.name and saying what to do; a cached copy
    (here: the cache a locally saved dataset leaves, under the hub id's name) loads offline."""
    pytest.importorskip("datasets")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", HUB_SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["uncached"].startswith("data.hub.name: cannot load 'own-task-org/tiny' (config main, split 'train'): "
                                      "the Hugging Face Hub is out of reach and no copy is cached")
    assert "download it once where the hub is reachable" in out["uncached"]
    assert out["local"] == [["test 0?", {"answer": "0", "level": 0}], ["test 1?", {"answer": "1", "level": 1}]]
    assert out["cached"] == [[f"train {i}?", {"answer": str(i), "level": i}] for i in range(3)]
    assert out["bad_split"].startswith("data.hub.split: cannot load 'own-task-org/tiny' (config default, split 'nope')")


def test_own_task_eval_of_a_hub_source_reads_its_test_split(tmp_path):
    hub = "source: hf_hub\nhub: {name: org/x, test_split: test}\n"
    assert data_spec(tmp_path, hub, "eval: {}\n").eval is not None
    with pytest.raises(SpecError, match=r"eval.data_path: expected a held-out file: set eval.data_path or "
                                        r"data.hub.test_split, got neither"):
        data_spec(tmp_path, "source: hf_hub\nhub: {name: org/x}\n", "eval: {}\n")
