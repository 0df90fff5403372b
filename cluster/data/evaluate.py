"""GSM8K pass@1 of a model folder with the vLLM rollout engine (greedy decoding, one sample per problem).

    grpo-cluster eval --model runs/gsm8k_smollm2_cpu/checkpoints/step_000010 --data gsm8k/test.jsonl
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from cluster.data import DataError, Example, chat_prompt_ids, load_jsonl_examples
from cluster.spec import DEFAULT_SYSTEM_PROMPT
from grpo.rewards.checks import row_checks
from grpo.rewards.gsm8k import accuracy_reward, format_reward


def _gsm8k_rows(data: str) -> list[Example]:
    """The rows of a GSM8K jsonl file, each checked for the accuracy reward (an answer ending in '#### <number>').

    Raises:
        DataError: naming ``--data``, the flag that gave the file.
    """
    try:
        examples, _ = load_jsonl_examples(data, checks=row_checks({"accuracy": "--data"}), setting="--data")
    except DataError as exc:
        raise DataError(f"--data: {exc}") from None
    return examples


def check_eval_args(limit: int | None, max_tokens: int) -> None:
    """Raise ValueError unless ``limit`` is None or an int >= 1 and ``max_tokens`` is an int >= 1."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"--limit: expected a whole number >= 1 (or no --limit: all rows), got {limit!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"--max-tokens: expected a whole number >= 1, got {max_tokens!r}")


def engine_max_model_len(prompt_lengths: Sequence[int], max_tokens: int) -> int:
    """Engine context length in tokens: the longest prompt plus ``max_tokens`` of completion.

    Raises:
        ValueError: no prompts.
    """
    if not prompt_lengths:
        raise ValueError("expected at least one prompt to size the engine context, got none")
    return max(prompt_lengths) + max_tokens


def evaluate_gsm8k(model: str, data: str, limit: int | None = None, max_tokens: int = 256,
                   system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, kv_cache_gib: int = 2,
                   prompt_suffix: str = "", model_setting: str = "model.path") -> dict:
    """Greedy pass@1 on the first ``limit`` rows of a GSM8K jsonl file (all rows when ``limit`` is None).

    Prompts are token ids from `cluster.data.chat_prompt_ids` (with the training spec's ``data.system_prompt`` and
    ``data.prompt_suffix``, the ids training samples from, exactly one BOS), given to vLLM as token prompts. The
    engine's context length is the longest prompt plus ``max_tokens``. ``model_setting`` is what named ``model`` in
    messages (``--model`` for the command line).

    Returns:
        ``{"pass@1", "format", "n", "mean_tokens", "truncated", "seconds", "tokens_per_s", "problems"}`` (fractions
        in [0, 1]); ``problems`` holds one dict per problem in file order: ``index`` (row among the usable rows),
        ``question`` (its text, which identifies the problem for ``--against``), ``correct`` and ``format`` (0/1
        scores), ``tokens``, ``truncated`` (bool), ``completion`` (text).

    Raises:
        ValueError: ``limit`` not None and < 1, or ``max_tokens`` < 1 (checked before anything is loaded).
        DataError: the data file is missing or malformed. ModelError: ``model`` cannot be resolved.
    """
    check_eval_args(limit, max_tokens)
    import torch

    from cluster.data.models import resolve_model_path

    examples = _gsm8k_rows(data)
    examples = examples if limit is None else examples[:limit]
    path = resolve_model_path(model, setting=model_setting)
    from transformers import AutoTokenizer

    from cluster.spec import RolloutSpec
    from contract.messages import GroupRequest, SamplingOverride
    from rollout_workers.registry import rollout_engine

    # The same ids training samples from, given to the engine as token prompts (a text prompt would get BOS again).
    prompt_ids = chat_prompt_ids(AutoTokenizer.from_pretrained(path), examples, system_prompt, prompt_suffix)
    on_gpu = torch.cuda.is_available()
    rollout = RolloutSpec(max_response_tokens=max_tokens, kv_cache_gib=float(kv_cache_gib),
                          num_gpus_per_replica=1.0 if on_gpu else 0.0)
    engine = rollout_engine("vllm")(path, rollout, "auto" if on_gpu else "float32", 0,
                                    engine_max_model_len([len(ids) for ids in prompt_ids], max_tokens))
    greedy = SamplingOverride(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    groups, _ = engine.generate([GroupRequest(i, ids, group_size=1, sampling=greedy)
                                 for i, ids in enumerate(prompt_ids)], 1)
    seconds = time.perf_counter() - t0
    texts = [g.texts[0] for g in groups]
    n_tokens = [len(g.response_ids[0]) for g in groups]
    truncated = [g.finish_reasons[0] == "length" for g in groups]
    acc = [accuracy_reward(t, e.answer) for t, e in zip(texts, examples)]
    fmt = [format_reward(t) for t in texts]
    n = len(examples)
    return {
        "pass@1": sum(acc) / n, "format": sum(fmt) / n, "n": n,
        "mean_tokens": sum(n_tokens) / n,
        "truncated": sum(truncated) / n,
        "seconds": seconds, "tokens_per_s": sum(n_tokens) / max(seconds, 1e-9),
        "problems": [{"index": i, "question": e.question, "correct": a, "format": f, "tokens": k,
                      "truncated": cut, "completion": t}
                     for i, (e, a, f, k, cut, t) in enumerate(zip(examples, acc, fmt, n_tokens, truncated, texts))],
    }


def eval_questions(data: str, limit: int | None) -> list[str]:
    """The question texts, in order, that :func:`evaluate_gsm8k` with the same ``data`` and ``limit`` scores (cheap:
    reads the file only, so ``--against`` and ``--per-problem`` can be checked before the engine starts).

    Raises:
        ValueError: ``limit`` not None or an int >= 1. DataError: the data file is missing or malformed.
    """
    check_eval_args(limit, 1)
    examples = _gsm8k_rows(data)
    return [e.question for e in (examples if limit is None else examples[:limit])]


def check_writable(path: str, data: str) -> None:
    """Raise OSError unless ``path`` can take a ``--per-problem`` file: not a folder, not the ``--data`` file, in an
    existing folder where a file can be created (tried: a probe file is created and removed). Checked before the
    evaluation, so its work is not lost to a typo."""
    target = Path(path)
    if target.is_dir():
        raise OSError(f"--per-problem {path}: is a folder; give a file path")
    if target.exists() and Path(data).exists() and target.samefile(data):
        raise OSError(f"--per-problem {path}: is the --data file; writing there would overwrite the dataset")
    folder = target.parent
    if not folder.is_dir():
        raise OSError(f"--per-problem {path}: folder {folder} does not exist")
    try:  # for real, as write_per_problem will: os.access answers yes for root even where nothing can be written
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OSError(f"--per-problem {path}: a file cannot be created in {folder} ({exc.strerror or exc})") from None
    if target.exists() and not os.access(target, os.W_OK):
        raise OSError(f"--per-problem {path}: not writable (permission denied)")


def write_per_problem(path: str, result: dict) -> None:
    """Write ``result["problems"]`` (from :func:`evaluate_gsm8k`) to ``path`` as jsonl, one problem per line.

    Written to a temporary file in the same folder and renamed over ``path``, so a failed write (disk full) leaves
    any earlier file at ``path`` (possibly this run's ``--against`` baseline) whole.

    Raises:
        OSError: the folder cannot be written.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for row in result["problems"]:
                fh.write(json.dumps(row) + "\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_per_problem(path: str) -> list[dict]:
    """The rows, in order, of a file :func:`write_per_problem` wrote: dicts with ``index``, ``correct`` (0.0 or 1.0)
    and ``question`` (None in a file written before questions were recorded) and ``line`` (1-based line number).

    Raises:
        ValueError: no rows, invalid UTF-8, or a line that is not such a row (index 0, 1, ... in order, correct 0 or
            1, question a string if present), naming file and line. OSError: the file cannot be read (missing, a
            folder).
    """
    rows: list[dict] = []
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                row = json.loads(raw.decode("utf-8"))
                question = row.get("question")
                if (row["index"] != len(rows) or row["correct"] not in (0, 1)
                        or (question is not None and not isinstance(question, str))):
                    raise ValueError
            except (ValueError, KeyError, TypeError, AttributeError):  # UnicodeDecodeError is a ValueError
                raise ValueError(f"{path}:{line_no}: expected a per-problem row of `grpo-cluster eval --per-problem` "
                                 f"(index {len(rows)}, correct 0 or 1, question text)") from None
            rows.append({"index": len(rows), "correct": float(row["correct"]), "question": question,
                         "line": line_no})
    if not rows:
        raise ValueError(f"{path}: no per-problem rows (empty file); expected one line per problem of "
                         f"`grpo-cluster eval --per-problem`")
    return rows


def check_same_problems(rows: list[dict], questions: list[str], path: str) -> None:
    """Raise ValueError unless the ``--against`` rows are the problems about to be evaluated, in the same order.

    Args:
        rows: from :func:`read_per_problem`. questions: from :func:`eval_questions`. path: the rows' file, for the
            message.
    """
    if len(rows) != len(questions):
        raise ValueError(f"--against {path}: {len(rows)} problems, this evaluation has {len(questions)}; use the same "
                         f"--data and --limit")
    for row, question in zip(rows, questions):
        if row["question"] is not None and row["question"] != question:
            raise ValueError(f"--against {path}:{row['line']}: problem {row['index']} is {row['question'][:60]!r}, "
                             f"in --data it is {question[:60]!r}; use the same --data (file and row order)")
