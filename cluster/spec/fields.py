"""Field types, bounds and validators shared by the job spec's sections.

- :data:`SPEC_CONFIG`: every spec model rejects unknown keys, is frozen after validation and refuses inf/NaN.
- Bounds (``MAX_*``, :data:`MIN_TEMPERATURE`) that catch a mistyped extra digit before any resource is reserved, and
  the bounds of the numbers that reach the train step's float32 tensors (:data:`MAX_RATIO`, :data:`MAX_COEFFICIENT`):
  no accepted value overflows float32 there.
- :data:`ByteSize` (``"64MiB"`` → 67108864 via :func:`parse_byte_size`) and :data:`CustomResources` (a pool's custom
  Ray resources per actor, checked by :func:`check_custom_resources`).
- :data:`CpuCores` (a pool's CPU core ids, ``rollout.cpu_affinity`` / ``train.cpu_affinity``, checked by
  :func:`check_cpu_cores`).

Imports only pydantic and the standard library.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field, WithJsonSchema

__all__ = [
    "SPEC_CONFIG", "MAX_SEQUENCE_TOKENS", "MAX_SEED", "MAX_TOP_K", "MIN_TEMPERATURE", "MAX_TIMEOUT_S",
    "MAX_CUSTOM_RESOURCE", "CustomResources", "check_custom_resources", "parse_byte_size", "ByteSize",
    "MAX_CPU_ID", "CpuCores", "check_cpu_cores", "MAX_RATIO", "MAX_COEFFICIENT", "MAX_DEVICES_PER_ACTOR",
    "MAX_MEMORY_GIB", "MAX_BUCKET_BYTES", "MAX_COUNT", "NonEmptyStr", "FieldConflict", "unused_when_off",
]

#: Model config of every spec section: unknown keys rejected, frozen after validation, no inf/NaN.
SPEC_CONFIG = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

# Integer fields are strict: YAML (and --set) ints are accepted, but not true/false, "4" or 4.0. Float fields are
# strict too: ints and floats are accepted, true/false and strings ("0.5") are not (a lax float field took
# `kl_coef: yes` as 1.0). Upper bounds catch typos (an extra digit) before any resource is reserved.
MAX_SEQUENCE_TOKENS = 1_048_576
MAX_SEED = 2**31 - 1
MAX_TOP_K = 16_777_216  # far above any vocabulary; catches a mistyped extra digit
#: Lowest rollout temperature: vLLM's SamplingParams raises any temperature in (0, 0.01) to 0.01 (``_MAX_TEMP``,
#: with only a log warning), so a lower spec value would make the trainer's logprobs (at the spec's temperature)
#: describe another distribution than the one the engine sampled from.
MIN_TEMPERATURE = 0.01
#: Upper bound of every timeout (7 days): larger values overflow datetime.timedelta in torch.distributed.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: Largest importance ratio the train step forms: e^20 ≈ 4.85e8, the log ratio being clamped to ±20
#: (``grpo.policy_losses.LOG_RATIO_CLAMP``). A ratio bound above it (``tis_cap``, ``clip_eps_high``, ``dual_clip_c``,
#: ``mis.high``; ``mis.low`` below 1 / MAX_RATIO) never acts, and one far above it (1e39) is no float32 at all.
MAX_RATIO = math.exp(20.0)
#: Largest coefficient or scale that multiplies a float32 loss term, reward or weight (``kl_coef``, ``entropy_coef``,
#: reward weights, ``lr``, ...): with per-token terms at most ~e^20 (k3 at the ratio clamp) the products stay below
#: 1e15, far from float32's 3.4e38, and no useful setting comes near it.
MAX_COEFFICIENT = 1e6

#: Largest CPU or GPU count one actor (a replica, a rank, a reward worker) may reserve: above any node built today;
#: a typo guard (``num_cpus_per_replica: 1e39`` is refused at load, not as an unschedulable actor).
MAX_DEVICES_PER_ACTOR = 4096.0
#: Largest memory size in GiB a field may ask for (``rollout.kv_cache_gib``): 64 TiB, above any node; a typo guard.
MAX_MEMORY_GIB = 65536.0
#: Largest weight-sync bucket: 64 GiB (a bucket is one allocation on the trainer and on every engine).
MAX_BUCKET_BYTES = 64 * 2**30
#: Largest count of steps, sequences or versions a setting may name (every_steps, horizons, ...): a typo guard.
MAX_COUNT = 1_000_000_000
#: A string that must not be empty: an optional path, address or host written as ``""`` is refused (write null, or
#: leave the key out, for the default) instead of being taken silently as the default or as "every interface".
NonEmptyStr = Annotated[str, Field(min_length=1)]

class FieldConflict(ValueError):
    """A cross-field check failed; ``field`` is the dotted path (from the job root) the message should point at."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


#: Ray's builtin resources (lower case) → the field that sets each per actor; None: not settable per pool.
_BUILTIN_RESOURCES = {"cpu": "num_cpus", "gpu": "num_gpus", "memory": None, "object_store_memory": None}
#: Largest custom-resource amount per actor (a typo guard, like the bounds on counts).
MAX_CUSTOM_RESOURCE = 1_000_000.0
#: A pool's custom resources: strict names and amounts (``"1"`` or ``true`` are refused, ints are taken as floats).
CustomResources = dict[Annotated[str, Field(strict=True)], Annotated[float, Field(strict=True)]]


def check_custom_resources(resources: dict[str, float], section: str, per: str) -> dict[str, float]:
    """Validate a pool's custom Ray resources per actor (``{name: amount}``), e.g. ``{"rollout_node": 1}``.

    Checked here so that a mistake fails at spec load naming the field, not at actor creation (Ray's own rules plus
    typo guards): names are non-empty without whitespace and are not Ray's builtin ``CPU``/``GPU``/``memory``/
    ``object_store_memory`` in any letter case (CPUs and GPUs have their own fields, e.g.
    ``rollout.num_cpus_per_replica``); amounts are > 0, at most :data:`MAX_CUSTOM_RESOURCE`, and whole multiples of
    0.0001 (Ray's resource unit), at least one unit (an amount like 1.0e-11 passes a rounding tolerance but is 0
    units).

    Raises:
        ValueError: naming the resource, what was expected and what was given.
    """
    for name, amount in resources.items():
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"resource name {name!r}: expected a non-empty name without whitespace")
        if name.lower() in _BUILTIN_RESOURCES:
            field = _BUILTIN_RESOURCES[name.lower()]
            hint = f"set {section}.{field}_per_{per} instead" if field else "it cannot be reserved per pool"
            raise ValueError(f"resource {name!r} is one of Ray's builtin resources: {hint}")
        if not 0 < amount <= MAX_CUSTOM_RESOURCE:
            raise ValueError(f"resource {name!r}: expected an amount in (0, {MAX_CUSTOM_RESOURCE:g}], got {amount!r}")
        units = amount * 10_000
        if round(units) == 0 or abs(units - round(units)) > 1e-6:  # 1e-11 is 0 units: Ray would reserve nothing
            raise ValueError(f"resource {name!r}: expected a multiple of 0.0001 (Ray's resource unit), got {amount!r}")
    return resources


#: Largest CPU core id a spec may name (a typo guard: Linux's CONFIG_NR_CPUS is at most 8192).
MAX_CPU_ID = 8191
#: CPU core ids as ``os.sched_getaffinity`` numbers them: strict ints in [0, MAX_CPU_ID].
CpuCores = list[Annotated[int, Field(strict=True, ge=0, le=MAX_CPU_ID)]]


def check_cpu_cores(cores: list[int] | None) -> list[int] | None:
    """Validate a pool's CPU core ids (``rollout.cpu_affinity``, ``train.cpu_affinity``): None (no binding) or a
    non-empty list without repeats; each id's range is :data:`CpuCores`'s. Whether the cores exist and may be used is
    checked where the process runs (its node's ``os.sched_getaffinity``), not here.

    Raises:
        ValueError: an empty list, or the ids repeated (named).
    """
    if cores is None:
        return None
    if not cores:
        raise ValueError("expected at least one CPU core id, or null for no binding; got []")
    repeated = sorted({c for c in cores if cores.count(c) > 1})
    if repeated:
        raise ValueError(f"expected each CPU core id once, got {repeated} more than once in {cores}")
    return cores


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_byte_size(value: Any) -> Any:
    """Turn ``"64MiB"``, ``"512MB"``, ``"1GiB"`` or ``"4096"`` into an int number of bytes.

    Units (case-insensitive): B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024). Non-strings are
    returned unchanged for the int validator to judge. Raises ValueError for unknown units or fractional bytes.
    """
    if not isinstance(value, str):
        return value
    match = _BYTE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(f"expected a byte size such as 67108864, '64MiB', '512MB' or '1GiB', got {value!r}")
    number = float(match.group(1)) * _BYTE_UNITS[unit]
    if number != int(number):
        raise ValueError(f"expected a whole number of bytes, got {value!r} = {number} bytes")
    return int(number)


#: A byte count: an int, or a string with a unit that :func:`parse_byte_size` reads (its JSON Schema says both, so an
#: editor does not flag ``bucket_bytes: 64MiB``).
ByteSize = Annotated[int, BeforeValidator(parse_byte_size), WithJsonSchema({
    "anyOf": [{"type": "integer", "minimum": 0},
              {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(([kKmMgGtT][iI]?)?[bB])?\s*$",
               "examples": ["64MiB", "512MB", "1GiB"]}]})]


def unused_when_off(section: Any, fields: tuple[str, ...], prefix: str, needs: str) -> None:
    """Refuse a setting that takes effect only with another one, when it is set away from its default while that
    other one is off (the kind: ``reward_pool.resources`` with ``workers: 0``, ``algorithm.kl_target`` with a fixed
    KL coefficient): the user believes it acts.

    Args:
        section: the validated section model. fields: its settings that need ``needs``. prefix: the section's dotted
            name (``"reward_pool"``). needs: the condition they need, as the user would write it.
    Raises:
        FieldConflict: naming the first such field.
    """
    for name in fields:
        default = type(section).model_fields[name].get_default(call_default_factory=True)
        if getattr(section, name) != default:
            raise FieldConflict(f"{prefix}.{name}", (
                f"has no effect unless {needs}: leave it out (default {default!r}) or set {needs}; got "
                f"{getattr(section, name)!r}"))

