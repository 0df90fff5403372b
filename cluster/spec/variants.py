"""Spec fields that select a registered variant by name; the registry is the one owner of the names.

A field such as ``algorithm.kl_estimator`` is a plain string, checked when the spec is validated against the keys its
registry holds at that moment (:data:`SELECTORS` lists which field reads which registry). So registering a variant
is all it takes to select it from a spec, provided the module that registers it is imported before the spec is
validated (``grpo-cluster run/validate/submit --import MODULE``, or an ``import`` before ``load_spec``)::

    from grpo.kl import register_kl_estimator

    @register_kl_estimator("k3_clipped")
    def k3_clipped(logprobs, ref_logprobs): ...      # now `algorithm.kl_estimator: k3_clipped` validates

An unknown name fails as a ``ValueError`` (reported by :mod:`cluster.spec.loading` with the field's file:line) that
gives the value, the registered names, the closest one when there is one (:func:`difflib.get_close_matches`) and
how to register a new one.

A registered variant may also carry the companion settings its source prescribes (``grpo.registry.set_implied``:
GSPO's clip range for ``policy_loss: gspo``); :func:`implied_by_choices` reads them for a section's rule of settings
its choices imply (:mod:`cluster.spec.implied`), and each :class:`Registered` names the settings that belong with its
choice (``companions``), which ``grpo-cluster validate`` prints beside it.

The registries are imported lazily, at validation (``grpo`` imports torch): this module itself imports only pydantic,
the standard library and :mod:`cluster.spec.fields`. ``train.strategy`` reads ``train_workers.registry``,
``rollout.engine`` ``rollout_workers.registry`` and ``metrics.trackers`` ``cluster.sinks.trackers.registry``; each
holds ``"module:Class"`` strings and imports no implementation.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import AfterValidator

from cluster.spec.fields import FieldConflict

__all__ = [
    "ADVANTAGE_ESTIMATOR", "KL_ESTIMATOR", "LOSS_AGGREGATION", "MIS_LEVEL", "POLICY_LOSS", "ROLLOUT_ENGINE",
    "SELECTORS", "TIS_LEVEL", "TRACKER", "TRAIN_BACKEND", "Registered", "implied_by_choices",
    "model_parallel_strategies",
]


@dataclass(frozen=True)
class Registered:
    """The registry one spec field selects a variant from.

    Attributes:
        field: the spec field, dotted from the job root (``"algorithm.kl_estimator"``).
        kind: what an entry is, for messages (``"KL estimator"``).
        registry: where the names live, for messages and descriptions (``"grpo.kl.KL_ESTIMATORS"``).
        register: how to add an entry, with ``NAME`` where the new name goes
            (``'@register_kl_estimator("NAME") from grpo.kl'``).
        load: returns the registry (a mapping whose keys are the names); imports it on first call.
        companions: the fields of the same section whose values belong with the choice (the clip range of a policy
            loss), which ``grpo-cluster validate`` prints beside it.
    """

    field: str
    kind: str
    registry: str
    register: str
    load: Callable[[], Mapping[str, Any]]
    companions: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The field's name in its section (``"kl_estimator"``)."""
        return self.field.rsplit(".", 1)[-1]

    def implied(self, value: Any) -> tuple[dict[str, Any], str]:
        """The settings choosing ``value`` implies and why (``grpo.registry.implied_by`` of its entry); nothing for
        a value that is not a registered name (validation reports it)."""
        from grpo.registry import implied_by

        entry = self.load().get(value) if isinstance(value, str) else None
        return implied_by(entry) if entry is not None else ({}, "")

    def names(self) -> list[str]:
        """The names registered now, sorted."""
        return sorted(self.load())

    def check(self, value: str) -> str:
        """``value`` if it is a registered name.

        Raises:
            ValueError: an unknown name; the message gives the value, the registered names, the closest one (when
                close) and how to register a new one.
        """
        known = self.names()
        if value in known:
            return value
        raise ValueError(unknown_name_message(self, value, known))

    @property
    def validator(self) -> AfterValidator:
        """A pydantic validator for ``Annotated[str, ...]`` running :meth:`check`."""
        return AfterValidator(self.check)

    def describe(self, what: str, builtins: str) -> str:
        """A field description: ``what`` the field selects, where its names come from, and the ``builtins``."""
        return (f"{what}: a name registered in {self.registry} (add one with {self.register.replace('NAME', 'name')} "
                f"in a module imported before the spec is validated, e.g. with --import MODULE). "
                f"Built in: {builtins}.")


def unknown_name_message(registered: Registered, value: str, known: list[str]) -> str:
    """``unknown <kind> <value> (did you mean ...?); expected one registered in <registry>: <names>. Register a new
    one with ...``.

    The suggestion is the closest registered name by :func:`difflib.get_close_matches` (cutoff 0.6, letter case
    ignored), omitted when none is that close.
    """
    lowered = {name.lower(): name for name in known}
    close = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.6)
    hint = f" (did you mean {lowered[close[0]]!r}?)" if close else ""
    how = registered.register.replace("NAME", value)
    return (f"unknown {registered.kind} {value!r}{hint}; expected one registered in {registered.registry}: "
            f"{', '.join(known) or 'none'}. Register a new one with {how} in a module imported before the spec is "
            f"validated (e.g. grpo-cluster run --import MODULE)")


def _advantage_estimators() -> Mapping[str, Any]:
    from grpo.advantages import ADVANTAGE_ESTIMATORS

    return ADVANTAGE_ESTIMATORS


def _loss_aggregations() -> Mapping[str, Any]:
    from grpo.losses import LOSS_AGGREGATIONS

    return LOSS_AGGREGATIONS


def _policy_losses() -> Mapping[str, Any]:
    from grpo.policy_losses import POLICY_LOSSES

    return POLICY_LOSSES


def _kl_estimators() -> Mapping[str, Any]:
    from grpo.kl import KL_ESTIMATORS

    return KL_ESTIMATORS


def _tis_levels() -> Mapping[str, Any]:
    from grpo.off_policy import TIS_LEVELS

    return TIS_LEVELS


def _mis_levels() -> Mapping[str, Any]:
    from grpo.off_policy import MIS_LEVELS

    return MIS_LEVELS


def _train_backends() -> Mapping[str, Any]:
    from train_workers.registry import TRAIN_BACKENDS  # names and "module:Class" strings: no backend is imported

    return TRAIN_BACKENDS


def _rollout_engines() -> Mapping[str, Any]:
    from rollout_workers.registry import ROLLOUT_ENGINES  # names and "module:Class" strings: no engine is imported

    return ROLLOUT_ENGINES


def _trackers() -> Mapping[str, Any]:
    from cluster.sinks.trackers.registry import TRACKERS  # names and "module:Class" strings: no tracker library

    return TRACKERS


ADVANTAGE_ESTIMATOR = Registered("algorithm.advantage_estimator", "advantage estimator",
                                 "grpo.advantages.ADVANTAGE_ESTIMATORS",
                                 '@register_advantage_estimator("NAME") from grpo.advantages', _advantage_estimators,
                                 ("adv_eps", "adv_std", "loss_agg"))
LOSS_AGGREGATION = Registered("algorithm.loss_agg", "loss aggregation", "grpo.losses.LOSS_AGGREGATIONS",
                              '@register_loss_aggregation("NAME") from grpo.losses', _loss_aggregations)
POLICY_LOSS = Registered("algorithm.policy_loss", "policy loss", "grpo.policy_losses.POLICY_LOSSES",
                         '@register_policy_loss("NAME") from grpo.policy_losses', _policy_losses,
                         ("clip_eps_low", "clip_eps_high", "dual_clip_c"))
KL_ESTIMATOR = Registered("algorithm.kl_estimator", "KL estimator", "grpo.kl.KL_ESTIMATORS",
                          '@register_kl_estimator("NAME") from grpo.kl', _kl_estimators,
                          ("kl_coef", "kl_controller", "kl_in_reward"))
TIS_LEVEL = Registered("algorithm.tis_level", "TIS level", "grpo.off_policy.TIS_LEVELS",
                       '@register_tis_level("NAME") from grpo.off_policy', _tis_levels, ("tis_cap",))
MIS_LEVEL = Registered("algorithm.mis.level", "MIS level", "grpo.off_policy.MIS_LEVELS",
                       '@register_mis_level("NAME") from grpo.off_policy', _mis_levels, ("low", "high"))
TRAIN_BACKEND = Registered("train.strategy", "train backend", "train_workers.registry.TRAIN_BACKENDS",
                           'register_train_backend("NAME", "module:Class") from train_workers.registry',
                           _train_backends, ("tensor_parallel_size", "pipeline_parallel_size", "sequence_parallel"))
ROLLOUT_ENGINE = Registered("rollout.engine", "rollout engine", "rollout_workers.registry.ROLLOUT_ENGINES",
                            'register_rollout_engine("NAME", "module:Class") from rollout_workers.registry',
                            _rollout_engines)
TRACKER = Registered("metrics.trackers", "tracker", "cluster.sinks.trackers.registry.TRACKERS",
                     'register_tracker("NAME", "module:Class") from cluster.sinks.trackers.registry', _trackers)

#: Every spec field that selects a registered variant, with its registry (``metrics.trackers``: each list entry).
SELECTORS: tuple[Registered, ...] = (ADVANTAGE_ESTIMATOR, POLICY_LOSS, LOSS_AGGREGATION, KL_ESTIMATOR, TIS_LEVEL,
                                     MIS_LEVEL, TRAIN_BACKEND, TRACKER, ROLLOUT_ENGINE)


def implied_by_choices(values: Mapping[str, Any], selectors: tuple[Registered, ...],
                       defaults: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """A section's :data:`cluster.spec.implied.Rule` over its registry-selected fields: the settings each chosen
    variant implies (``grpo.registry.set_implied``), with why: ``"<field> <name>: <its source>"``.

    Args:
        values: the section's values (raw data or a validated section's). selectors: its registry-selected fields.
        defaults: each selector's default (the value a section that leaves it out chooses).

    Raises:
        FieldConflict: two chosen variants imply different values of a setting the spec leaves out (naming it: the
            spec must set it).
    """
    out: dict[str, tuple[Any, str]] = {}
    for selector in selectors:
        choice = values.get(selector.name, defaults[selector.name])
        settings, why = selector.implied(choice)
        for setting, value in settings.items():
            if setting in values:  # given: kept as written, nothing to imply
                continue
            if setting in out and out[setting][0] != value:
                field = f"{selector.field.rsplit('.', 1)[0]}.{setting}"
                raise FieldConflict(field, f"{selector.field}={choice!r} implies {setting} {value!r}, another choice "
                                           f"{out[setting][0]!r} ({out[setting][1]}); set {setting} in the spec")
            out.setdefault(setting, (value, f"{selector.field} {choice}: {why}"))
    return out


def model_parallel_strategies() -> list[str]:
    """``train.strategy`` names whose backend honours tensor/pipeline/sequence parallelism
    (``train_workers.registry.MODEL_PARALLEL_BACKENDS`` among the registered ones), sorted."""
    from train_workers.registry import MODEL_PARALLEL_BACKENDS, TRAIN_BACKENDS

    return sorted(name for name in MODEL_PARALLEL_BACKENDS if name in TRAIN_BACKENDS)
