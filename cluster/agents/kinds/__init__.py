"""Agent kinds: what a worker runs as one episode (:class:`contract.agents.EpisodeRun`), built from the job's
:class:`cluster.agents.plan.AgentPlan` and chosen by name from :data:`AGENT_KINDS`.

- ``function`` (:mod:`cluster.agents.kinds.function`): the user's ``async def run(client, row, **options)``
  (``rollout.agent``);
- ``environment`` (:mod:`cluster.agents.kinds.environment`): one of our own environments
  (``grpo.environments``: ``rollout.multi_turn.environment``) driven through the endpoint, a chat call per turn
  (``rollout.multi_turn.runner: agent_pool``);
- the ecosystem kinds (:data:`ECOSYSTEM_KINDS`), environments of another library run unchanged, named
  ``rollout.agent: "<library>:<environment id>"``: ``textarena`` (:mod:`cluster.agents.kinds.textarena_env`,
  single-player TextArena games) and ``gymnasium`` (:mod:`cluster.agents.kinds.gymnasium_env`, Gymnasium text
  environments). Their libraries are optional extras, imported only by their own modules, when used.

A kind is one module exporting ``build(plan) -> EpisodeRun``; adding one costs a module and a registry line (the
spec chooses it: ``cluster.agents.plan.agent_kind_name``); an ecosystem kind registers an
:class:`~cluster.agents.kinds.ecosystem.EcosystemKind` with :func:`register_ecosystem_kind`, which also reserves its
name as a prefix of ``rollout.agent``.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.agents.kinds import environment, function, gymnasium_env, textarena_env
from cluster.agents.kinds.ecosystem import EcosystemKind
from cluster.agents.plan import AgentPlan
from contract.agents import EpisodeRun
from grpo.registry import Registry

__all__ = ["AGENT_KINDS", "ECOSYSTEM_KINDS", "build_episode_run", "ecosystem_key", "register_agent_kind",
           "register_ecosystem_kind"]

#: kind name → ``build(plan)``, which returns the kind's :class:`EpisodeRun` (it may import and check user code).
AGENT_KINDS: Registry[Callable[[AgentPlan], EpisodeRun]] = Registry("agent kind")


def register_agent_kind(name: str):
    """Decorator adding ``build(plan) -> EpisodeRun`` to :data:`AGENT_KINDS` under ``name`` (a duplicate raises)."""
    def decorator(build):
        AGENT_KINDS[name] = build
        return build

    return decorator


#: library name → its ecosystem kind; the name is also the kind's name in :data:`AGENT_KINDS` and a reserved prefix of
#: ``rollout.agent`` (``textarena:GuessTheNumber-v0``).
ECOSYSTEM_KINDS: Registry[EcosystemKind] = Registry("ecosystem agent kind")


def register_ecosystem_kind(kind: EcosystemKind) -> EcosystemKind:
    """Add ``kind`` to :data:`ECOSYSTEM_KINDS` and its ``build`` to :data:`AGENT_KINDS` under ``kind.name`` (a
    duplicate raises)."""
    ECOSYSTEM_KINDS[kind.name] = kind
    AGENT_KINDS[kind.name] = kind.build
    return kind


def ecosystem_key(key: str) -> tuple[EcosystemKind, str] | None:
    """(the kind, the environment id) of a ``rollout.agent`` key ``<library>:<environment id>`` whose library is an
    ecosystem kind's name; None for any other key (``file.py:function``, ``module:function``)."""
    prefix, sep, environment_id = key.partition(":")
    return (ECOSYSTEM_KINDS[prefix], environment_id) if sep and prefix in ECOSYSTEM_KINDS else None


def build_episode_run(plan: AgentPlan) -> EpisodeRun:
    """The :class:`EpisodeRun` of ``plan.kind``.

    Raises:
        ValueError: an unknown kind (naming the registered ones). The kind's own errors (e.g.
            ``cluster.agents.loading.AgentLoadError``: the agent does not import here).
    """
    return AGENT_KINDS.lookup(plan.kind)(plan)


AGENT_KINDS["function"] = function.build
AGENT_KINDS["environment"] = environment.build
register_ecosystem_kind(textarena_env.KIND)
register_ecosystem_kind(gymnasium_env.KIND)
