"""Issue #30's break-it kinds in the job spec, each tested over all of its members (the spec's own fields, walked):

- a number the spec accepts but nothing can hold: every int/float field has an upper bound (or a cross-field one);
- an empty string taken silently as the default (``checkpoint.dir: ""``) or as "every interface" (``metrics.host``);
- a setting that has no effect because the setting it needs is off (``reward_pool.resources`` with ``workers: 0``);
- a resource shortage that does not name the fields reserving the resource;
- ``${VAR}`` written in a reward endpoint's URL sent as is.
"""

from __future__ import annotations

import typing
from typing import Annotated

import annotated_types
import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from cluster.ray_shell.pools import InsufficientResources, check_cluster_resources, reserving_fields
from cluster.spec import JobSpec, SpecError, load_spec_text
from grpo.rewards import REWARD_FUNCTIONS
from cluster.rewards.endpoint import expand_url

MINIMAL = "output_dir: runs/test\ntotal_steps: 3\ndata:\n  train_path: train.jsonl\n"

#: Numeric fields whose upper bound is a cross-field check, not a constant: why each cannot overflow.
CROSS_FIELD_BOUNDS = {
    "algorithm.mis.low": "below 1 and below mis.high (MisSpec._band)",
    "algorithm.overlong_buffer_tokens": "at most rollout.max_response_tokens",
}
#: String fields where "" is a value of its own, not a stand-in for the default.
EMPTY_MEANS_SOMETHING = {
    "data.system_prompt": "an empty system message (null sends none)",
    "data.prompt_suffix": "nothing appended (the default)",
}


def spec_fields(model: type[BaseModel], prefix: str = ""):
    """(dotted name, FieldInfo) of every field of ``model`` and of the sections nested in it (dict values too)."""
    for name, field in model.model_fields.items():
        for arg in typing.get_args(field.annotation) or (field.annotation,):
            for candidate in (arg, *typing.get_args(arg)):
                if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                    yield from spec_fields(candidate, f"{prefix}{name}.")
        yield prefix + name, field


def is_number_field(field) -> bool:
    args = typing.get_args(field.annotation) or (field.annotation,)
    return any(a in (int, float) for a in args) and not any(a is bool for a in args)


def test_every_number_field_has_an_upper_bound():
    unbounded = [name for name, field in spec_fields(JobSpec) if is_number_field(field)
                 and not any(isinstance(m, (annotated_types.Le, annotated_types.Lt)) for m in field.metadata)
                 and name not in CROSS_FIELD_BOUNDS]
    assert unbounded == [], f"numeric spec fields without an upper bound: {unbounded}"


@pytest.mark.parametrize("setting", ["rollout.kv_cache_gib=1e39", "rollout.num_cpus_per_replica=1e39",
                                     "train.num_gpus_per_worker=1e39", "reward_pool.num_cpus_per_worker=1e39",
                                     "algorithm.kl_target=1e39", "sync.bucket_bytes=100000000000000000000"])
def test_a_huge_number_is_refused_at_load_naming_the_field(setting):
    with pytest.raises(SpecError, match=rf"--set {setting.split('=')[0]}: Input should be less than or equal"):
        load_spec_text(MINIMAL, overrides=[setting])


def test_every_string_field_refuses_the_empty_string_unless_it_means_something():
    accepted = []
    for name, field in spec_fields(JobSpec):
        annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        try:
            TypeAdapter(annotation).validate_python("")
        except ValidationError:
            continue
        accepted.append(name)
    assert sorted(accepted) == sorted(EMPTY_MEANS_SOMETHING), accepted


@pytest.mark.parametrize("key, optional", [("checkpoint.dir", True), ("model.cache_dir", True),
                                           ("ray.address", True), ("metrics.host", True), ("output_dir", False)])
def test_an_empty_string_says_how_to_ask_for_the_default(key, optional):
    with pytest.raises(SpecError) as info:
        load_spec_text(MINIMAL, overrides=[f'{key}=""'])
    text = str(info.value)
    assert f"--set {key}: empty string: expected a non-empty value" in text, text
    assert ("write null or leave the key out" in text) == optional, text


@pytest.mark.parametrize("setting, needs, enabling", [
    ("reward_pool.resources={cpu_node: 1}", "reward_pool.workers >= 1", "reward_pool.workers=1"),
    ("reward_pool.num_cpus_per_worker=0.5", "reward_pool.workers >= 1", "reward_pool.workers=1"),
    ("reward_pool.batch_size=8", "reward_pool.workers >= 1", "reward_pool.workers=1"),
    ("reward_pool.timeout_s=10", "reward_pool.workers >= 1", "reward_pool.workers=1"),
    ("reward_pool.start_timeout_s=10", "reward_pool.workers >= 1", "reward_pool.workers=1"),
    ("algorithm.kl_target=0.05", "algorithm.kl_controller: adaptive", "algorithm.kl_controller=adaptive"),
    ("algorithm.kl_horizon_sequences=100", "algorithm.kl_controller: adaptive", "algorithm.kl_controller=adaptive"),
    ("sync.verify_full_every=3", "sync.verify: sample", "sync.verify=sample"),
])
def test_a_setting_without_the_setting_it_needs_is_refused_naming_both(setting, needs, enabling):
    key = setting.split("=")[0]
    with pytest.raises(SpecError) as info:
        load_spec_text(MINIMAL, overrides=[setting])
    assert f"--set {key}: has no effect unless {needs}" in str(info.value), str(info.value)
    load_spec_text(MINIMAL, overrides=[setting, enabling])  # with what it needs, it is taken


def test_the_default_values_written_out_are_not_refused():
    load_spec_text(MINIMAL + "reward_pool: {workers: 0, num_cpus_per_worker: 1.0, resources: {}}\n"
                             "algorithm: {kl_target: 0.01}\nsync: {verify: true, verify_full_every: 10}\n")


def test_a_resource_shortage_names_the_fields_that_reserve_it():
    spec = load_spec_text(MINIMAL + "rollout: {num_gpus_per_replica: 1, resources: {rm_node: 1}}\n"
                                    "train: {num_gpus_per_worker: 0.5, world_size: 2}\n"
                                    "reward_pool: {workers: 2, num_cpus_per_worker: 0.5, resources: {rm_node: 2}}\n")
    assert reserving_fields(spec, "GPU") == ["rollout.num_gpus_per_replica", "train.num_gpus_per_worker"]
    assert reserving_fields(spec, "CPU") == ["rollout.num_cpus_per_replica", "train.num_cpus_per_worker",
                                             "reward_pool.num_cpus_per_worker"]
    assert reserving_fields(spec, "rm_node") == ["rollout.resources.rm_node", "reward_pool.resources.rm_node"]
    with pytest.raises(InsufficientResources) as info:
        check_cluster_resources(spec, have={"CPU": 64.0, "GPU": 1.0})
    text = str(info.value)
    assert ("GPU 2 (rollout 1 x 1 + train 2 x 0.5), cluster has 1 (set by rollout.num_gpus_per_replica, "
            "train.num_gpus_per_worker)") in text, text
    assert "rm_node 5 (rollout 1 x 1 + reward 2 x 2), cluster has 0 (set by rollout.resources.rm_node, " \
           "reward_pool.resources.rm_node)" in text, text
    assert "CPU" not in text


def test_endpoint_urls_take_environment_variables(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_RM_HOST", "rm.internal:8000")
    try:
        spec = load_spec_text(MINIMAL + "reward_endpoints:\n  rm: {url: 'http://${GRPO_TEST_RM_HOST}/score', "
                                        "health_url: '${GRPO_TEST_RM_URL_NOT_SET}'}\n", source="job.yaml")
    except SpecError as exc:
        assert "rm.health_url: environment variable GRPO_TEST_RM_URL_NOT_SET is not set" in str(exc), str(exc)
    else:
        raise AssertionError(f"an unset variable was taken: {spec.reward_endpoints}")
    finally:
        REWARD_FUNCTIONS.pop("rm", None)
    try:
        load_spec_text(MINIMAL + "reward_endpoints:\n  rm: {url: 'http://${GRPO_TEST_RM_HOST}/score'}\n")
        assert REWARD_FUNCTIONS["rm"].url == "http://rm.internal:8000/score"
    finally:
        REWARD_FUNCTIONS.pop("rm", None)
    assert expand_url(None) is None
    with pytest.raises(ValueError, match=r"expected an http:// or https:// URL without spaces, got 'ftp://x' "
                                         r"\(from '\$\{V\}'\)"):
        expand_url("${V}", {"V": "ftp://x"})
