"""Spec fields that select a registered variant (``cluster.spec.variants``): the registry is the one owner of the names.

For each such field: a variant registered with the project's own ``register_*`` call is selectable from a spec (and
is the one the algorithm runs), and selectable no longer once removed; an unknown name fails through the loader with
file:line, the field, the value, every registered name, the closest one and how to register a new one. No spec field
may copy a registry's names into a ``Literal`` (walked over every model of :class:`JobSpec`), and every field that
reads a registry is listed in :data:`SELECTORS` and describes its registry and built-in names.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args, get_origin

import pytest
import torch
from pydantic import BaseModel

from cluster.spec import JobSpec, SpecError, load_spec, load_spec_text, spec_to_yaml
from cluster.spec import variants
from tests.registered import variant_registered

MINIMAL = """\
output_dir: runs/test
total_steps: 3
data:
  train_path: train.jsonl
"""


def load(*overrides: str) -> JobSpec:
    return load_spec_text(MINIMAL, source="job.yaml", overrides=overrides)


def value_at(spec: BaseModel, dotted: str):
    for part in dotted.split("."):
        spec = getattr(spec, part)
    return spec


# ---- one case per field: how a user registers a variant, and what running it gives


def _mean_baseline(rewards, stats, *, eps, std):
    return rewards - stats.mean[stats.group_index]


def _sum_over_tokens(masked_loss, mask, *, num_tokens, num_sequences, max_response_tokens):
    return masked_loss.sum()


def _reinforce(logprobs, old_logprobs, advantages, mask, *, clip_eps_low, clip_eps_high, dual_clip_c):
    from grpo.policy_losses import PolicyTerm

    return PolicyTerm(pg=-advantages * logprobs, ratio=torch.ones_like(logprobs), clipped=torch.zeros_like(mask))


def _abs_k1(logprobs, ref_logprobs):
    return (logprobs - ref_logprobs).abs()


def _all_ones(old_logprobs, behaviour_logprobs, response_mask, cap):
    return torch.where(response_mask, torch.ones(()), torch.zeros(()))


def _keep_first_token(log_ratio, known, response_mask, log_low, log_high):
    keep = torch.zeros_like(response_mask)
    keep[:, 0] = True
    return keep


def _run_advantage(name):
    rewards, groups = torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 1])
    from grpo.advantages import compute_advantages

    return compute_advantages(rewards, groups, name).tolist() == [0.5, -0.5, 0.0, 0.0]


def _run_loss(name):
    from grpo.losses import aggregate_loss

    loss = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    return aggregate_loss(loss, mask, name).item() == 6.0


def _run_policy_loss(name):
    from grpo.losses import policy_loss

    logp, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[True, True]])
    loss, _ = policy_loss(logp, logp, torch.tensor([1.0]), mask, clip_eps_low=0.2, clip_eps_high=0.2,
                          loss_agg="token-mean", loss_mode=name)
    return loss.item() == 1.5


def _run_kl(name):
    from grpo.kl import kl_penalty

    return kl_penalty(torch.tensor([-1.0]), torch.tensor([-0.5]), name).tolist() == [0.5]


def _run_tis(name):
    from grpo.off_policy import importance_weights

    mask = torch.tensor([[True, False]])
    return importance_weights(torch.zeros(1, 2), torch.full((1, 2), -3.0), mask, 2.0, name).tolist() == [[1.0, 0.0]]


def _run_mis(name):
    from grpo.off_policy import mis_keep_mask

    mask = torch.tensor([[True, True], [False, True]])
    keep = mis_keep_mask(torch.zeros(2, 2), torch.zeros(2, 2), mask, 0.5, 2.0, name)
    return keep.tolist() == [[True, False], [False, False]]  # its own choice, within the response mask


def _run_train_backend(name):
    from train_workers.fsdp_worker import FSDPTrainWorker
    from train_workers.registry import train_backend

    return train_backend(name) is FSDPTrainWorker


class _RecordingTracker:
    """A tracker (``contract.trackers.Tracker``) that records what it is given."""

    name, package, install = "recording", "json", "nothing"
    calls: list = []

    def __init__(self, spec, output_dir):
        self.output_dir = output_dir

    def location(self):
        return str(self.output_dir)

    def open(self, config):
        type(self).calls.append(("open", config["spec"]["total_steps"]))

    def log(self, step, numbers):
        type(self).calls.append(("log", step, dict(numbers)))

    def artifacts(self, png, tables, spec_yaml):
        type(self).calls.append(("artifacts", [table.name for table in tables]))

    def close(self):
        type(self).calls.append(("close",))


def _run_tracker(name):
    import tempfile

    from cluster.sinks.trackers import build_trackers
    from contract.trackers import Tracker

    _RecordingTracker.calls = []
    with tempfile.TemporaryDirectory() as out:
        (sink,) = build_trackers(load(f"metrics.trackers=[{name}]"), out)
        assert isinstance(sink.backend, Tracker)
        sink.log(1, {"reward/mean": 0.5, "note": "text"})
        sink.close()
    return _RecordingTracker.calls == [("open", 3), ("log", 1, {"reward/mean": 0.5}), ("artifacts", ["eval/table"]),
                                       ("close",)]


def _run_rollout_engine(name):
    from rollout_workers.hf.engine import HFEngine
    from rollout_workers.registry import rollout_engine

    return rollout_engine(name) is HFEngine


@dataclass(frozen=True)
class Case:
    """``selector``: the field's registry; ``register(name)``: the user's registration; ``sets(value)``: overrides
    selecting ``value``; ``yaml(value)``: spec text with the field's value on the line holding ``value``; ``typo`` is
    refused and suggests ``close``; ``runs(name)``: the algorithm runs the registered variant; ``value(name)``: the
    field's value when ``name`` is selected (a list field holds it in a list); ``at``: where the loader says the
    value is, when not the field itself."""

    selector: variants.Registered
    register: Callable[[str], object]
    sets: Callable[[str], list[str]]
    yaml: Callable[[str], str]
    typo: str
    close: str
    runs: Callable[[str], bool]
    value: Callable[[str], object] = lambda name: name
    at: str = ""

    @property
    def located(self) -> str:
        """The field as the loader names it in a message (a list entry: ``metrics.trackers.0``)."""
        return self.at or self.selector.field


def _register_advantage(name):
    from grpo.advantages import register_advantage_estimator

    return register_advantage_estimator(name)(_mean_baseline)


def _register_loss(name):
    from grpo.losses import register_loss_aggregation

    return register_loss_aggregation(name)(_sum_over_tokens)


def _register_policy_loss(name):
    from grpo.policy_losses import register_policy_loss

    return register_policy_loss(name)(_reinforce)


def _register_kl(name):
    from grpo.kl import register_kl_estimator

    return register_kl_estimator(name)(_abs_k1)


def _register_tis(name):
    from grpo.off_policy import register_tis_level

    return register_tis_level(name)(_all_ones)


def _register_mis(name):
    from grpo.off_policy import register_mis_level

    return register_mis_level(name)(_keep_first_token)


def _register_train(name):
    from train_workers.registry import register_train_backend

    return register_train_backend(name, "train_workers.fsdp_worker:FSDPTrainWorker")


def _register_tracker(name):
    from cluster.sinks.trackers.registry import register_tracker

    return register_tracker(name, _RecordingTracker)


def _register_rollout_engine(name):
    from rollout_workers.registry import register_rollout_engine

    return register_rollout_engine(name, "rollout_workers.hf.engine:HFEngine")


CASES = [
    Case(variants.ADVANTAGE_ESTIMATOR, _register_advantage, lambda v: [f"algorithm.advantage_estimator={v}"],
         lambda v: f"algorithm:\n  advantage_estimator: {v}\n", "rlo", "rloo", _run_advantage),
    Case(variants.POLICY_LOSS, _register_policy_loss, lambda v: [f"algorithm.policy_loss={v}"],
         lambda v: f"algorithm:\n  policy_loss: {v}\n", "cispoo", "cispo", _run_policy_loss),
    Case(variants.LOSS_AGGREGATION, _register_loss, lambda v: [f"algorithm.loss_agg={v}"],
         lambda v: f"algorithm:\n  kl_coef: 0.1\n  loss_agg: {v}\n", "token_mean", "token-mean", _run_loss),
    Case(variants.KL_ESTIMATOR, _register_kl, lambda v: [f"algorithm.kl_estimator={v}"],
         lambda v: f"algorithm:\n  kl_estimator: {v}\n", "K33", "k3", _run_kl),
    Case(variants.TIS_LEVEL, _register_tis, lambda v: [f"algorithm.tis_level={v}", "algorithm.tis_cap=2"],
         lambda v: f"algorithm:\n  tis_cap: 2.0\n  tis_level: {v}\n", "sequense", "sequence", _run_tis),
    Case(variants.MIS_LEVEL, _register_mis,
         lambda v: [f"algorithm.mis.level={v}", "algorithm.mis.low=0.5", "algorithm.mis.high=2"],
         lambda v: f"algorithm:\n  mis:\n    low: 0.5\n    level: {v}\n    high: 2.0\n", "tokn", "token", _run_mis),
    Case(variants.TRAIN_BACKEND, _register_train, lambda v: [f"train.strategy={v}"],
         lambda v: f"train:\n  world_size: 1\n  strategy: {v}\n", "megatorn", "megatron", _run_train_backend),
    Case(variants.TRACKER, _register_tracker, lambda v: [f"metrics.trackers=[{v}]"],
         lambda v: f"metrics:\n  trackers:\n  - {v}\n  - mlflow\n", "tensorbord", "tensorboard", _run_tracker,
         value=lambda v: [v], at="metrics.trackers.0"),
    Case(variants.ROLLOUT_ENGINE, _register_rollout_engine, lambda v: [f"rollout.engine={v}"],
         lambda v: f"rollout:\n  engine: {v}\n", "vlm", "vllm", _run_rollout_engine),
]
IDS = [case.selector.field for case in CASES]
NEW = "test_registered_variant"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_registered_variant_is_selectable_and_runs(case):
    field = case.selector.field
    with pytest.raises(SpecError, match=rf"(--set |: ){re.escape(case.located)}: unknown {case.selector.kind} '{NEW}'"):
        load(*case.sets(NEW))
    with variant_registered(case.selector.load(), NEW, lambda: case.register(NEW)):
        spec = load(*case.sets(NEW))
        assert value_at(spec, field) == case.value(NEW)
        assert load_spec_text(spec_to_yaml(spec), source="round trip") == spec
        assert case.runs(NEW)
        with pytest.raises(SpecError, match=rf"registered in {re.escape(case.selector.registry)}: .*\b{NEW}\b"):
            load(*case.sets(case.typo))  # the names in the message are read at validation too
    assert NEW not in case.selector.load()
    with pytest.raises(SpecError, match=rf"unknown {case.selector.kind} '{NEW}'"):
        load(*case.sets(NEW))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_unknown_name_fails_with_file_line_known_names_suggestion_and_how_to_register(case, tmp_path):
    text = MINIMAL + case.yaml(case.typo)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if re.search(rf"(: |- ){case.typo}$", row))
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    sel = case.selector
    assert "(1 problem)" in message, message
    assert f"{path}:{line}: {case.located}: unknown {sel.kind} '{case.typo}' (did you mean '{case.close}'?); " \
           f"expected one registered in {sel.registry}: {', '.join(sel.names())}. " in message, message
    assert f"Register a new one with {sel.register.replace('NAME', case.typo)} in a module imported before the " \
           f"spec is validated (e.g. grpo-cluster run --import MODULE)" in message, message


def test_no_suggestion_when_no_name_is_close():
    with pytest.raises(SpecError) as info:
        load("algorithm.kl_estimator=forward_kl")
    message = str(info.value)
    assert "unknown KL estimator 'forward_kl'; expected one registered in grpo.kl.KL_ESTIMATORS: k1, k2, k3." in (
        message), message
    assert "did you mean" not in message


def test_a_non_string_is_refused_as_before():
    with pytest.raises(SpecError, match=r"--set algorithm.loss_agg: Input should be a valid "
                                        r"string \(got 3\)"):
        load("algorithm.loss_agg=3")


def test_model_parallel_fields_follow_the_registry():
    """TP/PP/SP are accepted with a backend registered with ``model_parallel=True`` and refused with one registered
    without, the message naming the model-parallel strategies registered now."""
    from train_workers.registry import TRAIN_BACKENDS, register_train_backend

    worker = "train_workers.fsdp_worker:FSDPTrainWorker"
    tp2 = ("train.world_size=2", "train.tensor_parallel_size=2")
    with variant_registered(TRAIN_BACKENDS, "tp_backend", lambda: register_train_backend(
            "tp_backend", worker, model_parallel=True)):
        assert load("train.strategy=tp_backend", *tp2).train.tensor_parallel_size == 2
        with variant_registered(TRAIN_BACKENDS, "dp_backend", lambda: register_train_backend("dp_backend", worker)):
            with pytest.raises(SpecError, match=r"--set train\.tensor_parallel_size, --set train\.strategy: "
                                                r"train\.tensor_parallel_size: tensor_parallel_size=2 needs strategy "
                                                r"'megatron' or 'tp_backend'; strategy 'dp_backend' shards only by "
                                                r"data parallelism \(expected tensor_parallel_size=1\)"):
                load("train.strategy=dp_backend", *tp2)
    with pytest.raises(SpecError, match=r"needs strategy 'megatron'; strategy 'fsdp'"):
        load("train.strategy=fsdp", *tp2)


# ---- no Literal copies of a registry's names


def registries() -> dict[str, set[str]]:
    """Every registry's names: each ``grpo.registry.Registry`` defined in a ``grpo`` module, the train backends and
    the rollout engines."""
    import grpo
    from grpo.registry import Registry
    from rollout_workers.registry import ROLLOUT_ENGINES
    from train_workers.registry import TRAIN_BACKENDS

    found: dict[int, tuple[str, set[str]]] = {}
    for info in pkgutil.walk_packages(grpo.__path__, "grpo."):
        module = importlib.import_module(info.name)
        for attr, value in vars(module).items():
            if isinstance(value, Registry):
                found.setdefault(id(value), (f"{info.name}.{attr}", set(value)))
    named = dict(found.values())
    named["train_workers.registry.TRAIN_BACKENDS"] = set(TRAIN_BACKENDS)
    named["rollout_workers.registry.ROLLOUT_ENGINES"] = set(ROLLOUT_ENGINES)
    return named


def _literal_values(annotation) -> list[set]:
    """The value sets of every ``Literal`` in an annotation, nested ones included (not inside nested models)."""
    if get_origin(annotation) is Literal:
        return [set(get_args(annotation))]
    return [values for arg in get_args(annotation) for values in _literal_values(arg)]


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models(arg)]


#: Literal values that equal a registered name by coincidence, not as a copy: (field, value) -> why.
COINCIDENCES = {
    ("data.source", "reasoning_gym"): "a prompt source; the reward function of the same name scores its problems",
}


def literal_copies(model: type[BaseModel], names: dict[str, set[str]], prefix: str = "",
                   allowed: dict[tuple[str, str], str] | None = None) -> list[str]:
    """``field: Literal values [...] repeat <registry>'s names [...]`` for every field of ``model`` (nested models
    walked, fields dotted from ``prefix``) whose Literal holds a name some registry holds, but for the (field,
    value) pairs in ``allowed``."""
    allowed = allowed or {}
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        for values in _literal_values(field.annotation):
            for registry, keys in names.items():
                copied = sorted(v for v in values & keys if (path, v) not in allowed)
                if copied:
                    out.append(f"{path}: Literal values {sorted(values, key=str)} repeat {registry}'s names "
                               f"{copied}; validate against the registry (cluster.spec.variants)")
        for nested in _models(field.annotation):
            out += literal_copies(nested, names, f"{path}.", allowed)
    return out


def test_no_spec_field_copies_a_registrys_names_into_a_literal():
    names = registries()
    assert {"grpo.advantages.ADVANTAGE_ESTIMATORS", "grpo.losses.LOSS_AGGREGATIONS", "grpo.kl.KL_ESTIMATORS",
            "grpo.policy_losses.POLICY_LOSSES",
            "grpo.off_policy.TIS_LEVELS", "grpo.off_policy.MIS_LEVELS", "grpo.rewards.REWARD_FUNCTIONS",
            "train_workers.registry.TRAIN_BACKENDS"} <= set(names)
    assert literal_copies(JobSpec, names, allowed=COINCIDENCES) == []
    assert [line.split(":")[0] for line in literal_copies(JobSpec, names)] == ["data.source"]  # the one coincidence


def test_the_literal_check_finds_a_copy_in_a_nested_model():
    class Inner(BaseModel):
        level: Literal["token", "sequence"] = "token"

    class Outer(BaseModel):
        kl: Literal["k1", "k2", "k3"] = "k3"
        mode: bool | Literal["sample"] = True
        inner: Inner | None = None
        levels: tuple[Literal["token", "other"], ...] = ()

    found = literal_copies(Outer, registries())
    assert [line.split(":")[0] for line in found] == ["kl", "inner.level", "inner.level", "levels", "levels"], found
    assert "kl: Literal values ['k1', 'k2', 'k3'] repeat grpo.kl.KL_ESTIMATORS's names ['k1', 'k2', 'k3']" in found[0]


# ---- SELECTORS is complete and every description tells where the names come from


def selector_fields(model: type[BaseModel], prefix: str = "") -> dict[str, variants.Registered]:
    """{dotted field: its Registered} for every field validated by a ``Registered.validator``, on the field itself or
    on the entries of a list field (``list[Annotated[str, validator]]``)."""
    out = {}
    for name, field in model.model_fields.items():
        entries = [meta for arg in get_args(field.annotation) for meta in getattr(arg, "__metadata__", ())]
        for meta in (*field.metadata, *entries):
            owner = getattr(getattr(meta, "func", None), "__self__", None)
            if isinstance(owner, variants.Registered):
                out[f"{prefix}{name}"] = owner
        for nested in _models(field.annotation):
            out.update(selector_fields(nested, f"{prefix}{name}."))
    return out


def test_selectors_list_every_field_that_reads_a_registry():
    fields = selector_fields(JobSpec)
    assert fields == {sel.field: sel for sel in variants.SELECTORS}
    assert sorted(fields) == sorted(IDS)  # and this module tests each of them


@pytest.mark.parametrize("selector", variants.SELECTORS, ids=lambda s: s.field)
def test_descriptions_name_the_registry_and_every_builtin(selector):
    section, *rest = selector.field.split(".")
    model = JobSpec.model_fields[section].annotation
    for part in rest[:-1]:
        model = _models(model.model_fields[part].annotation)[0]
    description = model.model_fields[rest[-1]].description
    assert f"a name registered in {selector.registry} (add one with " in description, description
    builtins = description.split("Built in: ", 1)[1]
    for name in selector.names():  # the registries hold their builtins only: every test removes what it adds
        assert re.search(rf"(^|[ (]){re.escape(name)}\b", builtins), (name, description)
