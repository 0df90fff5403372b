"""Named registries for algorithm variants (advantage estimators, KL estimators, loss aggregations, rewards).

A `Registry` is a `dict` from a name (one of the module's `Literal` names, or a new one registered by a user) to a
callable. Registering a name twice raises `ValueError`, whether through the `register` decorator or item assignment,
so two modules can never silently shadow each other's variant. Lookups of unknown names raise `ValueError` listing
the known names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry(dict[str, F], Generic[F]):
    """A `dict[str, F]` that refuses duplicate names.

    Args:
        kind: what the entries are, used in error messages (e.g. "advantage estimator").
        reserved: names that may never be registered, each mapped to the reason (e.g. a metric key it would
            overwrite); registering one raises `ValueError` with that reason.
        same_name: maps a name to the key under which it is used elsewhere (e.g. a Prometheus metric name, where
            ``none-fraction`` and ``none_fraction`` are one series); two names with the same key are the same name
            for the reserved and the duplicate checks. None: names are compared as they are.
    """

    def __init__(self, kind: str, reserved: Mapping[str, str] | None = None,
                 same_name: Callable[[str], str] | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.reserved = dict(reserved or {})
        self.same_name = same_name

    def __setitem__(self, name: str, fn: F) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty str, got {name!r}")
        key = self.same_name or (lambda n: n)
        reserved = next((r for r in sorted(self.reserved) if key(r) == key(name)), None)
        if reserved is not None:
            alias = "" if reserved == name else f" (the same name as {reserved!r} once used as a metric name)"
            raise ValueError(f"{self.kind} name {name!r} is reserved{alias}: {self.reserved[reserved]}; reserved "
                             f"names: {', '.join(sorted(self.reserved))}")
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered (to {self[name]!r}); names must be unique")
        clash = next((n for n in self if key(n) == key(name)), None)
        if clash is not None:
            raise ValueError(f"{self.kind} name {name!r} is the same name as the registered {clash!r} once used as a "
                             f"metric name ({key(name)!r}); names must be unique there too")
        super().__setitem__(name, fn)

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
