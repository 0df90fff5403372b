"""What a job checks and loads before any worker starts: writable output folders, the tokenizer, the model's EOS ids
and the training prompts as token ids. (The runtimes' own checks against the model — ``train.lora`` targets, the
model-parallel layout — are in :mod:`cluster.data.model_checks`.)

Every problem is raised here, naming the spec field, so ``grpo-cluster run`` and ``validate`` stop before Ray starts.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cluster.data import DataError, Example, chat_prompt_ids, chat_template_text
from cluster.data.models import ModelError, resolve_model_path
from cluster.data.sources import describe_source, load_examples
from grpo.eos import eos_token_ids
from grpo.rewards.checks import row_checks


class SetupError(RuntimeError):
    """The job cannot start here (an output folder that cannot be written, missing cluster resources)."""


@dataclass(frozen=True)
class Prompts:
    """The training prompts a job samples from.

    Attributes:
        examples: the rows kept (within ``data.max_prompt_tokens``), in file order.
        ids: example index → chat-templated prompt token ids.
        bad_rows: rows of the file skipped as unreadable (``data.on_bad_row: skip``).
        filtered: rows dropped for being longer than ``data.max_prompt_tokens`` tokens.
        source: where they came from, for status lines (`cluster.data.sources.describe_source`).
    """

    examples: list[Example]
    ids: dict[int, list[int]]
    bad_rows: int
    filtered: int
    source: str


def ensure_writable_dir(path: Path, field: str, create: bool = True) -> None:
    """Create ``path`` and prove it is writable now, before any worker starts; with ``create=False``, prove that it
    could be, leaving nothing behind: the deepest folder of ``path`` that exists is a folder where a file can be
    created and removed. Both try for real (``os.access`` answers yes for root, even in ``/proc``).

    Raises:
        SetupError: naming the spec field, the path and the OS error.
    """
    if not create:
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            raise SetupError(f"{field}: cannot write to {path}: {existing} is not a folder")
        try:
            fd, probe = tempfile.mkstemp(prefix=".grpo-cluster-write-test.", dir=existing)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise SetupError(f"{field}: cannot write to {path}: a file cannot be created in {existing} "
                             f"({exc.strerror or exc})") from None
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise SetupError(f"{field}: cannot write to {path}: {exc.strerror or exc}") from None


def check_before_start(spec, checkpoint_dir: Path, parts: Sequence, *, create: bool) -> tuple[str, object]:
    """A job's checks before anything starts, cheapest first: ``output_dir`` and ``checkpoint.dir`` (``checkpoint_dir``)
    writable (created when ``create``), the trackers' libraries (``metrics.trackers``), ``model.path`` resolved
    (``model.cache_dir``) and checked by each of ``parts`` that is not None (the trainer's and the fleet's ``check``),
    the reward endpoints answering (``reward_endpoints``); then the tokenizer is loaded. Returns (the model folder,
    the tokenizer).

    Raises:
        SetupError, ModelError, TrackerSetupError: naming the spec field and what is wrong.
    """
    from cluster.sinks.trackers import check_trackers
    from contract.model_source import ModelSource

    ensure_writable_dir(Path(spec.output_dir), "output_dir", create=create)
    ensure_writable_dir(checkpoint_dir, "checkpoint.dir", create=create)
    check_trackers(list(spec.metrics.trackers))  # their libraries, before anything heavy
    model_path = resolve_model_path(spec.model.path, spec.model.cache_dir)
    for part in parts:
        if part is not None:
            part.check(model_path)
    check_reward_endpoints(spec.reward_endpoints)
    return model_path, load_tokenizer(model_path, ModelSource.of(spec.model))


def load_tokenizer(model_path: str, source=None):
    """The model's HF tokenizer; ``source``: the spec's :class:`contract.model_source.ModelSource`
    (``model.revision``, ``model.trust_remote_code``), None for the defaults.

    Raises:
        ModelError: naming ``model.path`` and why the tokenizer cannot be loaded.
    """
    from transformers import AutoTokenizer

    from contract.model_source import ModelSource

    try:
        return AutoTokenizer.from_pretrained(model_path, **(source or ModelSource()).hf_kwargs(model_path))
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.path: cannot load a tokenizer from {model_path}: {exc}") from None


def model_eos_ids(model_path: str, tokenizer) -> frozenset[int]:
    """Every EOS id of the model: ``generation_config.json``'s ``eos_token_id`` (int or list) + the tokenizer's."""
    path = Path(model_path) / "generation_config.json"
    config_eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return eos_token_ids(config_eos, tokenizer.eos_token_id)


def reward_checks(names: Sequence[str], field: str) -> tuple:
    """The row checks (``grpo.rewards.checks``) of the rewards ``names``, which the spec field ``field`` names.

    Raises:
        DataError: naming ``field``, when a reward's function cannot be used (its signature).
    """
    from grpo.rewards import RewardError

    try:
        return row_checks({name: field for name in names})
    except (RewardError, ValueError) as exc:
        raise DataError(f"{field}: {exc}") from None


def prompt_ids(data, tokenizer, examples: Sequence[Example], what: str) -> list[list[int]]:
    """:func:`cluster.data.chat_prompt_ids` of ``examples`` with ``data``'s system prompt, suffix and chat template.

    Raises:
        DataError: naming ``data.chat_template`` when the template cannot render a prompt (``what``: the prompts'
            source, for the message).
    """
    template = chat_template_text(data)
    try:
        return chat_prompt_ids(tokenizer, examples, data.system_prompt, data.prompt_suffix, template)
    except Exception as exc:  # noqa: BLE001 - jinja2 and the tokenizer raise many types; the template is the cause
        if template is None:
            raise
        raise DataError(f"data.chat_template: cannot render the prompts of {what}: {type(exc).__name__}: {exc}") \
            from None


def load_prompts(data, tokenizer, rewards: Mapping[str, float] | Sequence[str] = ()) -> Prompts:
    """Read the training prompts from ``data.source`` (``data.train_path`` by default), chat-template and tokenize
    every prompt once, and drop (and count) those over ``data.max_prompt_tokens``.

    Args:
        data: the spec's ``data`` section.
        tokenizer: the model's tokenizer (its chat template builds the prompts, unless ``data.chat_template``).
        rewards: the rewards that score these prompts (``algorithm.rewards``): each row must pass their checks.

    Raises:
        DataError: the source cannot be read (prefixed with its spec field, ``data.train_path:``), a row a reward
            refuses, an unusable chat template, or every prompt is too long.
    """
    examples, bad_rows = load_examples(data, "train", reward_checks(list(rewards), "algorithm.rewards"))
    ids = prompt_ids(data, tokenizer, examples, describe_source(data))
    kept = [(ex, tok) for ex, tok in zip(examples, ids) if len(tok) <= data.max_prompt_tokens]
    if not kept:
        raise DataError(f"{describe_source(data)}: all {len(examples)} prompts are longer than "
                        f"data.max_prompt_tokens={data.max_prompt_tokens} tokens (the shortest has "
                        f"{min(map(len, ids))}); raise it")
    return Prompts(examples=[ex for ex, _ in kept], ids={ex.index: list(tok) for ex, tok in kept}, bad_rows=bad_rows,
                   filtered=len(examples) - len(kept), source=describe_source(data))


def check_reward_endpoints(endpoints: Mapping) -> None:
    """Probe every reward endpoint of the spec (``reward_endpoints``) once, before anything starts
    (``cluster.rewards.endpoint.EndpointReward.probe``: ``health_url`` answers 2xx, or an empty batch POSTed to
    ``url`` gets ``{"rewards": []}``), each within its ``probe_timeout_s``, its connection closed afterwards.

    Raises:
        SetupError: naming ``reward_endpoints.<name>.url`` (or ``.health_url``) and why the service did not answer.
    """
    from cluster.rewards.endpoint import EndpointReward, expand_headers

    for name, e in endpoints.items():
        endpoint = EndpointReward(name, e.url, timeout_s=e.timeout_s, headers=expand_headers(e.headers),
                                  health_url=e.health_url)
        try:
            why = endpoint.probe(e.probe_timeout_s)
        finally:
            endpoint.close()
        if why is not None:
            field = "health_url" if e.health_url is not None else "url"
            raise SetupError(f"reward_endpoints.{name}.{field}: the reward endpoint {name!r} does not answer: {why} "
                             f"(checked within probe_timeout_s={e.probe_timeout_s:g} s before anything starts); "
                             f"start the service or correct the address")
