"""Job spec validation: error messages name file, line, field, value; overrides; byte sizes; examples load."""

from pathlib import Path

import pydantic
import pytest

from cluster.spec import JobSpec, SpecError, load_spec, load_spec_text, parse_byte_size, spec_to_yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = Path(__file__).resolve().parents[2] / "tests" / "tiny_cpu.yaml"  # the tests' job, not an example

MINIMAL = """\
output_dir: runs/test
total_steps: 3
data:
  train_path: train.jsonl
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_minimal_spec_uses_defaults(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL))
    assert spec.total_steps == 3
    assert spec.rollout.group_size == 4
    assert spec.sync.bucket_bytes == 64 * 2**20
    assert spec.algorithm.rewards == {"accuracy": 1.0, "format": 0.1}
    assert spec.metrics.port == 9300
    assert "####" in spec.data.system_prompt


def test_empty_section_means_defaults(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL + "rollout:\n  # replicas: 2\nmetrics:\n"))
    assert spec.rollout.replicas == 1 and spec.metrics.port == 9300


def test_unknown_key_names_key_line_and_allowed(tmp_path):
    path = write(tmp_path, MINIMAL + "rollout:\n  replicas: 1\n  group_sise: 8\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    msg = str(info.value)
    assert (f"{path}:7: rollout.group_sise: unknown key 'group_sise' (did you mean 'group_size'?); allowed: "
            f"replicas,") in msg
    assert "group_size" in msg


def test_unknown_top_level_key(tmp_path):
    with pytest.raises(SpecError, match=r"job.yaml:5: bogus: unknown key 'bogus'; allowed: name, seed"):
        load_spec(write(tmp_path, MINIMAL + "bogus: 1\n"))


def test_out_of_range_names_field_value_and_bound(tmp_path):
    path = write(tmp_path, MINIMAL + "rollout:\n  group_size: 1\n  top_p: 1.5\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    msg = str(info.value)
    assert "2 problems" in msg
    assert f"{path}:6: rollout.group_size: Input should be greater than or equal to 2 (got 1)" in msg
    assert f"{path}:7: rollout.top_p: Input should be less than or equal to 1 (got 1.5)" in msg


def test_literal_lists_allowed_values(tmp_path):
    with pytest.raises(SpecError, match=r"job.yaml:6: train.backend: Input should be 'auto', 'gloo' or 'nccl' "
                                        r"\(got 'mpi'\)"):
        load_spec(write(tmp_path, MINIMAL + "train:\n  backend: mpi\n"))


def test_missing_required_fields(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, "data:\n  test_path: x\n"))
    msg = str(info.value)
    assert "output_dir: required key 'output_dir' is missing" in msg
    assert "total_steps: required key 'total_steps' is missing" in msg
    assert "job.yaml:1: data.train_path: required key 'train_path' is missing" in msg


def test_yaml_syntax_error_has_line(tmp_path):
    with pytest.raises(SpecError, match=r"job.yaml:7: invalid YAML: while parsing a flow sequence \(line 6\)"):
        load_spec(write(tmp_path, MINIMAL + "rollout:\n  replicas: [1, 2\n"))


def test_duplicate_key_is_an_error(tmp_path):
    with pytest.raises(SpecError, match=r"job.yaml:3: data: duplicate key 'data' \(first at line 1\)"):
        load_spec(write(tmp_path, "data: {}\ntotal_steps: 1\ndata: {}\n"))


def test_top_level_must_be_mapping(tmp_path):
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(write(tmp_path, "- 1\n- 2\n"))


def test_missing_spec_file(tmp_path):
    with pytest.raises(SpecError, match="spec file not found"):
        load_spec(tmp_path / "nope.yaml")


def test_overrides_parse_values_as_yaml(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL), [
        "rollout.group_size=8", "rollout.enforce_eager=false", "train.betas=[0.8, 0.9]", "train.lr=2e-6",
        "algorithm.rewards.format=0.5", "model.cache_dir=", "name=my job", "sync.bucket_bytes=1GiB",
    ])
    assert spec.rollout.group_size == 8
    assert spec.rollout.enforce_eager is False
    assert spec.train.betas == (0.8, 0.9)
    assert spec.train.lr == 2e-6
    assert spec.algorithm.rewards == {"format": 0.5}
    assert spec.model.cache_dir is None
    assert spec.name == "my job"
    assert spec.sync.bucket_bytes == 2**30


def test_override_errors(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(SpecError, match=r"unknown key 'group_sise' at rollout \(did you mean 'group_size'\?\); "
                                        r"allowed: replicas, "):
        load_spec(path, ["rollout.group_sise=8"])
    with pytest.raises(SpecError, match=r"unknown key 'rolout' at top level \(did you mean 'rollout'\?\); "
                                        r"allowed: name, seed"):
        load_spec(path, ["rolout.group_size=8"])
    with pytest.raises(SpecError, match=r"rollout.replicas is a value, not a section"):
        load_spec(path, ["rollout.replicas.x=1"])
    with pytest.raises(SpecError, match=r"expected 'dotted.key=value'"):
        load_spec(path, ["rollout.group_size"])
    with pytest.raises(SpecError, match=r"--set rollout.group_size: Input should be greater "
                                        r"than or equal to 2 \(got 1\)"):
        load_spec(path, ["rollout.group_size=1"])


def test_override_wins_over_yaml_line(tmp_path):
    path = write(tmp_path, MINIMAL + "rollout:\n  group_size: 4\n")
    with pytest.raises(SpecError, match=r"--set rollout: rollout.group_size"):
        load_spec(path, ["rollout={group_size: 0}"])


@pytest.mark.parametrize(("text", "expected"), [
    ("64MiB", 64 * 2**20), ("512MB", 512 * 10**6), ("1GiB", 2**30), ("1.5 KiB", 1536), ("4096", 4096),
    ("2kb", 2000), (8192, 8192),
])
def test_parse_byte_size(text, expected):
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("text", ["64 potatoes", "MiB", "-1MiB", "0.5B", "1e3"])
def test_parse_byte_size_rejects(text):
    with pytest.raises(ValueError, match="byte"):
        parse_byte_size(text)


def test_bucket_bytes_errors(tmp_path):
    with pytest.raises(SpecError, match=r"job.yaml:6: sync.bucket_bytes: expected a byte size .* got '64 potatoes'"):
        load_spec(write(tmp_path, MINIMAL + "sync:\n  bucket_bytes: 64 potatoes\n"))
    with pytest.raises(SpecError, match=r"sync.bucket_bytes: Input should be greater than or equal to 1024 "
                                        r"\(got 1000\)"):
        load_spec(write(tmp_path, MINIMAL), ["sync.bucket_bytes=1KB"])


def test_unknown_reward_lists_allowed(tmp_path):
    with pytest.raises(SpecError, match=r"algorithm.rewards: unknown reward 'length'; allowed: accuracy, code, "
                                        r"code_asserts, format, math, reasoning_gym; register one"):
        load_spec(write(tmp_path, MINIMAL), ["algorithm.rewards={accuracy: 1, length: 1}"])


def test_cross_field_checks(tmp_path):
    path = write(tmp_path, MINIMAL + "train:\n  backend: nccl\n")
    with pytest.raises(SpecError, match=r"job.yaml:6: train.backend: backend 'nccl' needs GPUs"):
        load_spec(path)
    load_spec(path, ["train.num_gpus_per_worker=1"])
    with pytest.raises(SpecError, match=r"rollout.max_model_len: expected max_model_len >= .* = 768, got 700"):
        load_spec(write(tmp_path, MINIMAL), ["rollout.max_model_len=700"])
    with pytest.raises(SpecError, match=r"ray.num_cpus: the job reserves 3 CPUs"):
        load_spec(write(tmp_path, MINIMAL), ["ray.num_cpus=2", "train.world_size=2"])


def test_non_finite_numbers_rejected(tmp_path):
    with pytest.raises(SpecError, match=r"train.lr: Input should be a finite number"):
        load_spec(write(tmp_path, MINIMAL), ["train.lr=.inf"])


def test_spec_is_frozen(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL))
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        spec.total_steps = 5
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        spec.rollout.group_size = 5


def test_round_trips(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL), ["sync.bucket_bytes=1MiB", "train.betas=[0.5, 0.6]"])
    assert JobSpec.model_validate(spec.model_dump()) == spec
    assert load_spec_text(spec_to_yaml(spec)) == spec
    again = tmp_path / "again.yaml"
    again.write_text(spec_to_yaml(spec))
    assert load_spec(again) == spec


def test_data_paths_resolve_next_to_spec(tmp_path, monkeypatch):
    (tmp_path / "train.jsonl").write_text("")
    monkeypatch.chdir("/")
    spec = load_spec(write(tmp_path, MINIMAL + "  test_path: missing.jsonl\n"))
    assert spec.data.train_path == str(tmp_path / "train.jsonl")
    assert spec.data.test_path == "missing.jsonl"
    assert spec.output_dir == "runs/test"
    assert load_spec(tmp_path / "job.yaml", ["data.train_path=train.jsonl"]).data.train_path == "train.jsonl"


@pytest.mark.parametrize("path", [EXAMPLES / "gsm8k_smollm2_cpu.yaml", TINY], ids=lambda path: path.name)
def test_examples_load(path):
    spec = load_spec(path)
    if path == TINY:
        assert spec.data.train_path.endswith("gsm8k/train.jsonl")
    else:  # the hub dataset (validating the spec needs no network; loading its rows does)
        assert (spec.data.source, spec.data.hub.name, spec.data.hub.config) == ("hf_hub", "openai/gsm8k", "main")
        assert (spec.data.hub.split, spec.data.hub.test_split) == ("train", "test")
    assert spec.sync.bucket_bytes >= 1024
    assert spec.train.world_size == 2


def test_example_values():
    demo = load_spec(EXAMPLES / "gsm8k_smollm2_cpu.yaml")
    assert (demo.total_steps, demo.rollout.prompts_per_step, demo.rollout.group_size) == (10, 4, 4)
    assert demo.algorithm.rewards == {"accuracy": 1.0, "format": 0.2}
    assert demo.sync.bucket_bytes == 64 * 2**20
    tiny = load_spec(TINY, ["model.path=/tmp/tiny"])
    assert (tiny.total_steps, tiny.rollout.prompts_per_step, tiny.rollout.max_response_tokens) == (2, 2, 16)
    assert tiny.metrics.port == 0 and tiny.model.path == "/tmp/tiny"


@pytest.mark.parametrize("yaml_rewards", ["", "algorithm:\n  rewards:\n    accuracy: 1.0\n"])
def test_error_inside_a_set_key_is_blamed_on_that_key(tmp_path, yaml_rewards):
    """The error is at algorithm.rewards, the value that caused it was set at algorithm.rewards.nope."""
    path = write(tmp_path, MINIMAL + yaml_rewards)
    with pytest.raises(SpecError) as info:
        load_spec(path, ["algorithm.rewards.nope=1"])
    assert "  --set algorithm.rewards.nope: algorithm.rewards: unknown reward 'nope'" in str(info.value)
    with pytest.raises(SpecError) as info:
        load_spec(path, ["algorithm.rewards.nope=1", "algorithm.rewards.bad=2"])
    assert "--set algorithm.rewards.nope, --set algorithm.rewards.bad: algorithm.rewards: unknown reward" in str(
        info.value)


def test_error_blame_prefers_the_yaml_line_when_no_set_key_is_involved(tmp_path):
    path = write(tmp_path, MINIMAL + "algorithm:\n  rewards:\n    nope: 1.0\n")
    with pytest.raises(SpecError, match=r"job.yaml:6: algorithm.rewards: unknown reward 'nope'"):
        load_spec(path, ["rollout.group_size=8"])


INT_FIELDS = [
    ("total_steps", None), ("seed", None), ("rollout", "replicas"), ("rollout", "tensor_parallel_size"),
    ("rollout", "prompts_per_step"), ("rollout", "group_size"), ("rollout", "max_response_tokens"),
    ("rollout", "max_model_len"), ("train", "world_size"), ("train", "num_threads"),
    ("train", "max_tokens_per_microbatch"), ("data", "max_prompt_tokens"), ("checkpoint", "every_steps"),
    ("metrics", "port"), ("metrics", "log_every_steps"), ("ray", "num_cpus"), ("sync", "bucket_bytes"),
    ("algorithm", "num_iterations"), ("algorithm", "kl_horizon_sequences"), ("algorithm", "max_sampling_rounds"),
    ("algorithm", "overlong_buffer_tokens"), ("algorithm", "group_size_max"),
]


def with_value(section: str, key: str | None, value: str) -> str:
    """MINIMAL with one field set to a YAML value (top-level keys replace MINIMAL's own)."""
    if key is None:
        lines = [ln for ln in MINIMAL.splitlines() if not ln.startswith(f"{section}:")]
        return "\n".join(lines) + f"\n{section}: {value}\n"
    if section == "data":
        return MINIMAL + f"  {key}: {value}\n"
    return MINIMAL + f"{section}:\n  {key}: {value}\n"


@pytest.mark.parametrize("section, key, value", [
    (section, key, value) for section, key in INT_FIELDS for value in ("true", "'8'", "8.0")
    if not (key == "bucket_bytes" and value == "'8'")  # byte sizes accept strings ('64MiB', '4096') by design
])
def test_integer_fields_are_strict(tmp_path, section, key, value):
    dotted = section if key is None else f"{section}.{key}"
    with pytest.raises(SpecError, match=rf"{dotted}: Input should be a valid integer"):
        load_spec(write(tmp_path, with_value(section, key, value)))
    with pytest.raises(SpecError, match=rf"--set {dotted}: Input should be a valid integer"):
        load_spec(write(tmp_path, MINIMAL), [f"{dotted}={value}"])


def _float_fields() -> list[tuple[str, str]]:
    """(section, key) of every float field (float or float | None) of the spec's sections, found by walking JobSpec."""
    import types

    def model_of(ann):
        if isinstance(ann, types.UnionType):  # an optional section: eval, monitor, train.lora
            ann = next(a for a in ann.__args__ if a is not type(None))
        return ann if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel) else None

    def walk(model, prefix: str) -> list[tuple[str, str]]:
        found = []
        for key, sub in model.model_fields.items():
            if sub.annotation in (float, float | None):
                found.append((prefix, key))
            elif (nested := model_of(sub.annotation)) is not None:  # data.reasoning_gym, train.lora, ...
                found += walk(nested, f"{prefix}.{key}")
        return found

    out = []
    for section, field in JobSpec.model_fields.items():
        if (model := model_of(field.annotation)) is not None:
            out += walk(model, section)
    return out


def test_float_fields_found():
    fields = _float_fields()
    assert {("eval", "temperature"), ("monitor", "kl_max"), ("algorithm", "kl_coef"), ("train", "lr"),
            ("train.lora", "alpha"), ("train.lora", "dropout"), ("algorithm.mis", "low"),
            ("algorithm.mis", "high")} <= set(fields)
    assert len(fields) >= 30


@pytest.mark.parametrize("section, key", _float_fields())
def test_float_fields_refuse_booleans_and_strings(tmp_path, section, key):
    # A lax float field took `kl_coef: yes` (YAML 1.1 true) as 1.0 and `temperature: '0.5'` as 0.5.
    # nested sections: what they need besides the field under test
    required = {"train.lora": {"rank": 8}, "algorithm.mis": {"level": "token"}}
    for value in ("true", "'0.5'"):
        if "." in section:
            outer, inner = section.split(".")
            fields = "".join(f"    {k}: {v}\n" for k, v in required.get(section, {}).items())
            head = "" if outer == "data" else f"{outer}:\n"  # MINIMAL's own data section takes the subsection
            text = MINIMAL + f"{head}  {inner}:\n{fields}    {key}: {value}\n"
            base = MINIMAL + f"{head}  {inner}:\n{fields}"
        else:
            text, base = with_value(section, key, value), MINIMAL
        with pytest.raises(SpecError, match=rf"{section}.{key}: Input should be a valid number"):
            load_spec(write(tmp_path, text))
        with pytest.raises(SpecError, match=rf"--set {section}.{key}: Input should be a valid number"):
            load_spec(write(tmp_path, base), [f"{section}.{key}={value}"])


def test_float_fields_take_ints_and_floats(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL + "train:\n  lr: 1e-6\n  betas: [0, 0.5]\n  max_grad_norm: 2\n"),
                     ["algorithm.kl_coef=0", "algorithm.rewards={accuracy: 1, format: 0.25}"])
    assert (spec.train.lr, spec.train.betas, spec.train.max_grad_norm) == (1e-6, (0.0, 0.5), 2.0)
    assert spec.algorithm.kl_coef == 0.0 and spec.algorithm.rewards == {"accuracy": 1.0, "format": 0.25}
    for key, value in (("train.betas", "[0.9, true]"), ("algorithm.rewards", "{accuracy: yes}")):
        with pytest.raises(SpecError, match=rf"{key}\.\w+: Input should be a valid number"):
            load_spec(write(tmp_path, MINIMAL), [f"{key}={value}"])


def test_integer_fields_accept_yaml_and_set_ints(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL + "rollout:\n  group_size: 8\nsync:\n  bucket_bytes: '4096'\n"),
                     ["rollout.prompts_per_step=16", "seed=7", "train.max_tokens_per_microbatch=16"])
    assert (spec.rollout.group_size, spec.rollout.prompts_per_step, spec.seed) == (8, 16, 7)
    assert (spec.train.max_tokens_per_microbatch, spec.sync.bucket_bytes) == (16, 4096)
    for text, expected in (("64MiB", 64 * 2**20), ("512MB", 512 * 10**6), ("2048", 2048)):
        assert load_spec(write(tmp_path, MINIMAL), [f"sync.bucket_bytes={text}"]).sync.bucket_bytes == expected


@pytest.mark.parametrize("dotted, value, bound", [
    ("rollout.group_size", 1025, "less than or equal to 1024"),
    ("rollout.prompts_per_step", 65537, "less than or equal to 65536"),
    ("rollout.max_response_tokens", 1_048_577, "less than or equal to 1048576"),
    ("data.max_prompt_tokens", 1_048_577, "less than or equal to 1048576"),
    ("train.world_size", 65537, "less than or equal to 65536"),
    ("rollout.replicas", 4097, "less than or equal to 4096"),
    ("total_steps", 10_000_001, "less than or equal to 10000000"),
    ("train.max_tokens_per_microbatch", 16_777_217, "less than or equal to 16777216"),
    ("train.max_tokens_per_microbatch", 15, "greater than or equal to 16"),
    ("seed", 2**31, "less than or equal to 2147483647"),
    ("algorithm.group_size_max", 1025, "less than or equal to 1024"),
])
def test_counts_have_upper_bounds(tmp_path, dotted, value, bound):
    with pytest.raises(SpecError, match=rf"--set {dotted}: Input should be {bound} \(got {value}\)"):
        load_spec(write(tmp_path, MINIMAL), [f"{dotted}={value}"])


def test_bounds_accept_their_limits(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL), [
        "rollout.group_size=1024", "rollout.prompts_per_step=65536", "rollout.max_response_tokens=1048576",
        "data.max_prompt_tokens=1048576", "total_steps=10000000", "train.max_tokens_per_microbatch=16777216"])
    assert spec.rollout.group_size == 1024
    defaults = JobSpec.model_validate({"output_dir": "o", "total_steps": 1, "data": {"train_path": "t"}})
    assert JobSpec.model_validate(defaults.model_dump()) == defaults  # every default passes its own bounds


def test_sampling_filters_accepted_and_passed_as_given(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL + "rollout:\n  top_p: 0.9\n  top_k: 50\n  min_p: 0.05\n"))
    assert (spec.rollout.top_p, spec.rollout.top_k, spec.rollout.min_p) == (0.9, 50, 0.05)
    default = load_spec(write(tmp_path, MINIMAL)).rollout
    assert (default.top_p, default.top_k, default.min_p) == (1.0, 0, 0.0)
    assert load_spec(write(tmp_path, MINIMAL + "rollout:\n  top_k: -1\n")).rollout.top_k == -1  # vLLM's "off"


@pytest.mark.parametrize(("body", "message"), [
    ("  top_k: -2\n", "rollout.top_k: Input should be greater than or equal to -1 (got -2)"),
    ("  top_k: 5.0\n", "rollout.top_k: Input should be a valid integer (got 5.0)"),
    ("  top_k: true\n", "rollout.top_k: Input should be a valid integer (got True)"),
    ("  min_p: 1.0\n", "rollout.min_p: Input should be less than 1 (got 1.0)"),
    ("  min_p: -0.1\n", "rollout.min_p: Input should be greater than or equal to 0 (got -0.1)"),
    # vLLM raises a temperature below 0.01 to 0.01: the trainer would compute logprobs at another temperature
    ("  temperature: 0.001\n", "rollout.temperature: Input should be greater than or equal to 0.01 (got 0.001)"),
    ("  temperature: 1.0e-300\n", "rollout.temperature: Input should be greater than or equal to 0.01 (got 1e-300)"),
])
def test_sampling_filters_out_of_range_name_field_and_line(tmp_path, body, message):
    path = write(tmp_path, MINIMAL + "rollout:\n" + body)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert f"{path}:6: {message}" in str(info.value)


def test_reduce_dtype_is_float32_or_the_model_dtype(tmp_path):
    assert load_spec(write(tmp_path, MINIMAL)).train.reduce_dtype == "float32"
    spec = load_spec(write(tmp_path, MINIMAL), ["model.dtype=bfloat16", "train.reduce_dtype=bfloat16"])
    assert (spec.model.dtype, spec.train.reduce_dtype) == ("bfloat16", "bfloat16")
    path = write(tmp_path, MINIMAL + "train:\n  reduce_dtype: bfloat16\n")
    with pytest.raises(SpecError, match=r"job.yaml:6: train.reduce_dtype: expected 'float32' or model.dtype "
                                        r"\('float32'\), got 'bfloat16'"):
        load_spec(path)
    with pytest.raises(SpecError, match=r"train.reduce_dtype"):
        load_spec(write(tmp_path, MINIMAL), ["model.dtype=bfloat16", "train.reduce_dtype=float16"])
    with pytest.raises(SpecError, match=r"train.reduce_dtype"):
        load_spec(write(tmp_path, MINIMAL), ["train.reduce_dtype=float64"])


@pytest.mark.parametrize("value", ["1", "'true'", "'yes'"])
def test_boolean_fields_are_strict(tmp_path, value):
    # a lax bool field took `health.enabled: 1` or the string 'yes' as true
    with pytest.raises(SpecError, match=r"health.enabled: Input should be a valid boolean"):
        load_spec(write(tmp_path, MINIMAL + f"health:\n  enabled: {value}\n"))
    with pytest.raises(SpecError, match=r"data.shuffle: Input should be a valid boolean"):
        load_spec(write(tmp_path, MINIMAL + f"  shuffle: {value}\n"))
