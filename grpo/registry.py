"""Named registries for algorithm variants (advantage estimators, KL estimators, loss aggregations, rewards).

A `Registry` is a `dict` from a name (one of the module's `Literal` names, or a new one registered by a user) to a
callable. Registering a name twice raises `ValueError`, whether through the `register` decorator or item assignment,
so two modules can never silently shadow each other's variant. Lookups of unknown names raise `ValueError` listing
the known names.

An entry may also be registered by where it lives (`Registry.register_lazy`: ``"package.module:attribute"``) and is
imported on its first lookup. That is how this package names entries that live in a package it must not import
(the ``code`` rewards in ``sandbox/``, docs/architecture.md): the name is known, the code is loaded only when used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, NamedTuple, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def split_target(target: str) -> tuple[str, str]:
    """``"package.module:attribute"`` → (module, attribute).

    Raises:
        ValueError: ``target`` is not of that form.
    """
    module, _, attribute = target.partition(":")
    if not module or not attribute.isidentifier():
        raise ValueError(f"expected a target 'package.module:attribute', got {target!r}")
    return module, attribute


def load_target(target: str) -> Any:
    """The object ``"package.module:attribute"`` names, its module imported.

    Raises:
        ValueError: ``target`` is not ``module:attribute``. ImportError: the module cannot be imported, or it has no
            such attribute (naming the target).
    """
    module, attribute = split_target(target)
    loaded = importlib.import_module(module)
    try:
        return getattr(loaded, attribute)
    except AttributeError:
        raise ImportError(f"{target}: module {module!r} has no attribute {attribute!r}") from None


class LazyEntry(NamedTuple):
    """A registry entry not imported yet: where it lives (``package.module:attribute``)."""

    target: str


class Registry(dict[str, F], Generic[F]):
    """A `dict[str, F]` that refuses duplicate names.

    Args:
        kind: what the entries are, used in error messages (e.g. "advantage estimator").
        reserved: names that may never be registered, each mapped to the reason (e.g. a metric key it would
            overwrite); registering one raises `ValueError` with that reason.
        reserved_prefixes: name prefixes that may never be registered (compared after ``same_name``), each mapped to
            the reason, e.g. ``scored_``: ``reward/scored_x`` is the Prometheus series of ``reward/scored/x``.
        same_name: maps a name to the key under which it is used elsewhere (e.g. a Prometheus metric name, where
            ``none-fraction`` and ``none_fraction`` are one series); two names with the same key are the same name
            for the reserved and the duplicate checks. None: names are compared as they are.

    Attributes:
        targets: name → ``package.module:attribute`` of each entry registered with `register_lazy` (kept after the
            entry was imported).
    """

    def __init__(self, kind: str, reserved: Mapping[str, str] | None = None,
                 same_name: Callable[[str], str] | None = None,
                 reserved_prefixes: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.reserved = dict(reserved or {})
        self.reserved_prefixes = dict(reserved_prefixes or {})
        self.same_name = same_name
        self.targets: dict[str, str] = {}

    def __setitem__(self, name: str, fn: F) -> None:
        self._check_new(name)
        super().__setitem__(name, fn)

    def register_lazy(self, name: str, target: str) -> None:
        """Register ``name`` as the object at ``target`` (``"package.module:attribute"``), imported on the first
        lookup of ``name`` (`load_target`); the same checks as registering the object itself.

        Raises:
            ValueError: as item assignment (a duplicate or reserved name), or ``target`` not ``module:attribute``.
        """
        try:
            split_target(target)
        except ValueError as exc:
            raise ValueError(f"{self.kind} {name!r}: {exc}") from None
        self._check_new(name)
        super().__setitem__(name, LazyEntry(target))
        self.targets[name] = target

    def __getitem__(self, name: str) -> F:
        value = super().__getitem__(name)
        if isinstance(value, LazyEntry):
            try:
                loaded = load_target(value.target)
            except ImportError as exc:
                raise ImportError(f"{self.kind} {name!r} lives in {value.target}, which cannot be loaded: "
                                  f"{exc}") from exc
            dict.__setitem__(self, name, loaded)
            return loaded
        return value

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """The entry (imported if it was registered lazily), or ``default``."""
        return self[name] if name in self else default

    def values(self) -> list[F]:  # type: ignore[override]
        """Every entry, lazy ones imported."""
        return [self[name] for name in self]

    def items(self) -> list[tuple[str, F]]:  # type: ignore[override]
        """(name, entry) pairs, lazy entries imported."""
        return [(name, self[name]) for name in self]

    def _check_new(self, name: str) -> None:
        """Raise `ValueError` unless ``name`` may be registered (the class doc)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty str, got {name!r}")
        key = self.same_name or (lambda n: n)
        reserved = next((r for r in sorted(self.reserved) if key(r) == key(name)), None)
        if reserved is not None:
            alias = "" if reserved == name else f" (the same name as {reserved!r} once used as a metric name)"
            raise ValueError(f"{self.kind} name {name!r} is reserved{alias}: {self.reserved[reserved]}; reserved "
                             f"names: {', '.join(sorted(self.reserved))}")
        prefix = next((p for p in sorted(self.reserved_prefixes) if key(name).startswith(key(p))), None)
        if prefix is not None:
            raise ValueError(f"{self.kind} name {name!r} starts with the reserved prefix {prefix!r}: "
                             f"{self.reserved_prefixes[prefix]}")
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered (to {dict.__getitem__(self, name)!r}); "
                             f"names must be unique")
        clash = next((n for n in self if key(n) == key(name)), None)
        if clash is not None:
            raise ValueError(f"{self.kind} name {name!r} is the same name as the registered {clash!r} once used as a "
                             f"metric name ({key(name)!r}); names must be unique there too")

    def update(  # type: ignore[override]
        self, other: Mapping[str, F] | Iterable[tuple[str, F]] = (), **kwargs: F
    ) -> None:
        items = other.items() if isinstance(other, Mapping) else other
        for name, fn in [*items, *kwargs.items()]:
            self[name] = fn

    def setdefault(self, name: str, fn: F) -> F:  # type: ignore[override]
        if name not in self:
            self[name] = fn
        return self[name]

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: `@REGISTRY.register("name")` adds the function under `name` and returns it unchanged."""

        def decorator(fn: F) -> F:
            self[name] = fn
            return fn

        return decorator

    def lookup(self, name: str) -> F:
        """The entry for `name`; `ValueError` naming the known entries if there is none."""
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; expected one of {sorted(self)}") from None


def set_implied(fn: F, settings: Mapping[str, Any] | None, why: str = "") -> F:
    """Record on a variant the settings of its spec section that choosing it implies when the spec leaves them out
    (``{field: value}``, e.g. GSPO's clip range for ``policy_loss: gspo``) and ``why`` (the source); returns ``fn``.

    Raises:
        ValueError: settings without a ``why``.
    """
    if settings and not why:
        raise ValueError(f"the settings {dict(settings)} a variant implies need their source (why), got none")
    fn.implied_settings = dict(settings or {})  # type: ignore[attr-defined]
    fn.implied_why = why  # type: ignore[attr-defined]
    return fn


def implied_by(fn: Callable[..., Any]) -> tuple[dict[str, Any], str]:
    """``(settings, why)`` recorded by :func:`set_implied` on a variant; ``({}, "")`` when none."""
    return dict(getattr(fn, "implied_settings", {}) or {}), getattr(fn, "implied_why", "")
