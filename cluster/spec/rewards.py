"""Where a job's reward functions run: the ``reward_pool`` section (workers in the driver, Ray actors or local
processes) and the ``reward_endpoints`` section (reward models served over HTTP, usable as ``algorithm.rewards``
keys). Imports only pydantic, :mod:`cluster.spec` modules and, lazily, ``cluster.rewards.endpoint`` (an endpoint is
registered as a reward function when the spec is validated)."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator, model_validator

from cluster.spec.fields import (
    MAX_DEVICES_PER_ACTOR, MAX_TIMEOUT_S, SPEC_CONFIG, CustomResources, check_custom_resources, unused_when_off,
)

__all__ = ["RewardEndpointSpec", "RewardPoolSpec", "register_endpoints"]


class RewardPoolSpec(BaseModel):
    """Where the reward functions run: in the driver (workers 0), or on reward workers (Ray actors; local processes
    on the in-process runtime) that score each engine's groups while the others still sample, so the loop never
    blocks on a slow verifier. A call that fails on a worker (it died, or ran past timeout_s) gives its completions
    no reward (infrastructure failures, docs/own_task.md) and the worker is replaced."""

    model_config = SPEC_CONFIG
    workers: int = Field(0, ge=0, le=4096, strict=True, description=(
        "Reward workers; 0 (the default) runs the reward functions in the driver as each engine's groups arrive."))
    num_cpus_per_worker: float = Field(1.0, strict=True, ge=0, le=MAX_DEVICES_PER_ACTOR, description=(
        "CPUs Ray reserves per reward worker (a CPU-bound verifier, the code sandbox: 1 or more)."))
    resources: CustomResources = Field(default_factory=dict, description=(
        "Custom Ray resources each reward worker reserves besides CPUs, e.g. {cpu_node: 1}; {} reserves none."))
    batch_size: int = Field(64, ge=1, le=1_000_000, strict=True, description=(
        "Completions per worker call; an engine's groups are cut into calls of at most this many."))
    timeout_s: float = Field(300, strict=True, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds one worker call may take; past it the worker is killed and replaced and the call's completions get "
        "no reward."))
    start_timeout_s: float = Field(120, strict=True, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds a reward worker may take to start and load the reward functions."))

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return check_custom_resources(resources, "reward_pool", "worker")

    @model_validator(mode="after")
    def _worker_settings_need_workers(self) -> RewardPoolSpec:
        if self.workers == 0:
            unused_when_off(self, ("num_cpus_per_worker", "resources", "batch_size", "timeout_s", "start_timeout_s"),
                            "reward_pool", "reward_pool.workers >= 1")
        return self


#: An endpoint URL as written in the spec: http(s)://... or one starting with an environment variable (${VAR}); the
#: expanded URL must be http(s):// (:func:`register_endpoints`).
_URL = r"^(https?://|\$\{)\S+$"


class RewardEndpointSpec(BaseModel):
    """A reward model served over HTTP: each batch is POSTed as {"prompts": [...], "completions": [...],
    "<column>": [...]} and answered with {"rewards": [float or null, ...]} (docs/own_task.md)."""

    model_config = SPEC_CONFIG
    url: str = Field(pattern=_URL, description=(
        "Where batches are POSTed (http:// or https://); ${VAR} is taken from the environment, e.g. "
        "'http://${RM_HOST}:8000/score'."))
    health_url: str | None = Field(None, pattern=_URL, description=(
        "Checked with GET (2xx = up) before the job starts; null: an empty batch is POSTed to url instead. ${VAR} "
        "is taken from the environment."))
    timeout_s: float = Field(60, strict=True, gt=0, le=MAX_TIMEOUT_S, description="Seconds one request may take.")
    max_retries: int = Field(2, ge=0, le=20, strict=True, description=(
        "Further attempts after a timeout, a refused connection, HTTP 5xx/408/429; then the batch gets no reward."))
    backoff_s: float = Field(0.5, strict=True, ge=0, le=3600, description=(
        "Wait before the first retry, doubled before each next one (exponential backoff)."))
    batch_size: int = Field(64, ge=1, le=1_000_000, strict=True, description="Completions per request.")
    headers: dict[str, str] = Field(default_factory=dict, description=(
        "HTTP headers sent with every request; ${VAR} in a value is taken from the environment (keep tokens out "
        "of the spec)."))
    probe_timeout_s: float = Field(5, strict=True, gt=0, le=MAX_TIMEOUT_S, description=(
        "Seconds the pre-start check may wait for the service."))


def register_endpoints(endpoints: dict[str, RewardEndpointSpec]) -> dict[str, RewardEndpointSpec]:
    """Register each endpoint as a reward function under its name (``cluster.rewards.endpoint.register_endpoint``),
    so ``algorithm.rewards`` and ``eval`` may name it.

    Raises:
        ValueError: a name that is not usable (a location-like ``a:b``, a builtin's, a reserved one) or a
            ``${VAR}`` of the headers or URLs that is not set, a URL that is not http(s):// once expanded; naming the
            endpoint and the field.
    """
    from cluster.rewards.endpoint import expand_headers, expand_url, register_endpoint

    for name, e in endpoints.items():
        if ":" in name or not name.strip():
            raise ValueError(f"reward endpoint name {name!r}: expected a plain name (no ':'), used as the reward's key "
                             f"in algorithm.rewards and in its metric reward/<name>")
        try:
            headers = expand_headers(e.headers)
        except KeyError as exc:
            raise ValueError(f"{name}.headers: environment variable {exc.args[0]} is not set") from None
        except ValueError as exc:
            raise ValueError(f"{name}.headers: {exc}") from None
        urls = {}
        for key in ("url", "health_url"):
            try:
                urls[key] = expand_url(getattr(e, key))
            except KeyError as exc:
                raise ValueError(f"{name}.{key}: environment variable {exc.args[0]} is not set") from None
            except ValueError as exc:
                raise ValueError(f"{name}.{key}: {exc}") from None
        try:
            register_endpoint(name, urls["url"], timeout_s=e.timeout_s, max_retries=e.max_retries,
                              backoff_s=e.backoff_s, batch_size=e.batch_size, headers=headers,
                              health_url=urls["health_url"])
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return endpoints
