"""Registration of specenv's environments with Gymnasium (run on ``import specenv``).

Gymnasium 1.x has no plugin entry points for environments: importing :mod:`specenv` calls
:func:`register_envs`, after which ``gymnasium.make("specenv/MoESpec-v1", ...)`` and
``gymnasium.make_vec("specenv/MoESpec-v1", num_envs=..., ...)`` work, and so does
``gymnasium.make("specenv/MoESpecSeq-v0", ...)`` (the per-token environment of the sequential
drafting mode) and ``gymnasium.make("specenv/MoESpecCap-v0", ...)`` (the joint (k, expert cap)
action). Users may also write
``gymnasium.register_envs(specenv)`` (keeps linters quiet about the import) or
``gymnasium.make("specenv:specenv/MoESpec-v1")``.

Versions (Gymnasium's convention: a change of the reward is a new version, the old one stays
registered): ``v1`` ids make the environment classes with their defaults (``reward="savings"``);
the ``v0`` ids remain, registered with ``reward="cost"`` (their default until v1), so code written
for v0 gets the same rewards as before. Both versions share the classes; an explicit ``reward=``
argument overrides either default.

``import specenv`` does not import Gymnasium itself (the cost model, trace sets and the oracle need
only numpy): :func:`register_when_imported` registers at once when Gymnasium is already loaded,
and otherwise right after Gymnasium's first import (a one-shot import hook).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

#: The replay environment (positions tables, cost model); deterministic given the seed.
REPLAY_ID = "specenv/MoESpec-v1"
#: The per-token environment of the sequential drafting mode (one draft decision per step); deterministic.
SEQ_ID = "specenv/MoESpecSeq-v0"
#: The live environment (real rounds on the CPU engine; needs the ``live`` extra); measured times vary.
LIVE_ID = "specenv/MoESpecLive-v1"
#: The joint (k, expert cap) replay environment (trace sets with the caps-v1 extension); deterministic.
CAP_ID = "specenv/MoESpecCap-v0"
#: The batch environment (B concurrent requests, one k each, batch cost model); deterministic.
BATCH_ID = "specenv/MoESpecBatch-v0"
#: The batch environment with one global token budget spent by the survival ranking; deterministic.
BATCH_BUDGET_ID = "specenv/MoESpecBatchBudget-v0"
#: The previous version of :data:`REPLAY_ID`: the same class with ``reward="cost"`` by default.
REPLAY_V0_ID = "specenv/MoESpec-v0"
#: The previous version of :data:`LIVE_ID`: the same class with ``reward="cost"`` by default.
LIVE_V0_ID = "specenv/MoESpecLive-v0"
#: The keyword arguments the v0 ids add (their default reward).
V0_KWARGS: dict[str, Any] = {"reward": "cost"}


#: Every id: (id, entry point, vector entry point or None, default kwargs, nondeterministic).
ENVIRONMENTS: tuple[tuple[str, str, str | None, dict[str, Any], bool], ...] = (
    (REPLAY_ID, "specenv.envs.replay:MoESpecEnv", "specenv.envs.vector:MoESpecVectorEnv", {}, False),
    (REPLAY_V0_ID, "specenv.envs.replay:MoESpecEnv", "specenv.envs.vector:MoESpecVectorEnv", V0_KWARGS, False),
    (LIVE_ID, "specenv.envs.live:MoESpecLiveEnv", None, {}, True),
    (LIVE_V0_ID, "specenv.envs.live:MoESpecLiveEnv", None, V0_KWARGS, True),
    (SEQ_ID, "specenv.envs.sequential:MoESpecSeqEnv", None, {}, False),
    (CAP_ID, "specenv.envs.caps:MoESpecCapEnv", None, {}, False),
    (BATCH_ID, "specenv.envs.batch:MoESpecBatchEnv", None, {}, False),
    (BATCH_BUDGET_ID, "specenv.envs.batch:MoESpecBatchBudgetEnv", None, {}, False),
)


def register_envs() -> list[str]:
    """Register every specenv environment id (:data:`ENVIRONMENTS`) that is not registered yet (idempotent).

    Returns:
        The ids registered by this call (empty when all were already present).
    """
    import gymnasium

    added = []
    for env_id, entry_point, vector_entry_point, kwargs, nondeterministic in ENVIRONMENTS:
        if env_id in gymnasium.registry:
            continue
        extra = {} if vector_entry_point is None else {"vector_entry_point": vector_entry_point}
        gymnasium.register(
            id=env_id,
            entry_point=entry_point,
            kwargs=dict(kwargs),
            nondeterministic=nondeterministic,
            max_episode_steps=None,
            **extra,
        )
        added.append(env_id)
    return added


def register_when_imported() -> None:
    """Register now if Gymnasium is imported, else right after Gymnasium's first import."""
    if "gymnasium" in sys.modules:
        register_envs()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("gymnasium", register_envs))


class _AfterImport(importlib.abc.MetaPathFinder):
    """One-shot finder: lets ``name`` load as usual, then calls ``callback`` once it has loaded."""

    def __init__(self, name: str, callback: Callable[[], Any]):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _CallbackLoader(spec.loader, self.callback)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    """Wraps a module's loader: runs ``callback`` after the module executed; delegates the rest."""

    def __init__(self, loader: Any, callback: Callable[[], Any]):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._callback()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
