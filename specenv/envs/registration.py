"""Registration of specenv's environments with Gymnasium (run on ``import specenv``).

Gymnasium 1.x has no plugin entry points for environments: importing :mod:`specenv` calls
:func:`register_envs`, after which ``gymnasium.make("specenv/MoESpec-v0", ...)`` and
``gymnasium.make_vec("specenv/MoESpec-v0", num_envs=..., ...)`` work. Users may also write
``gymnasium.register_envs(specenv)`` (keeps linters quiet about the import) or
``gymnasium.make("specenv:specenv/MoESpec-v0")``.
"""

from __future__ import annotations

import gymnasium

#: The replay environment (positions tables, cost model); deterministic given the seed.
REPLAY_ID = "specenv/MoESpec-v0"
#: The live environment (real rounds on the CPU engine; needs the ``live`` extra); measured times vary.
LIVE_ID = "specenv/MoESpecLive-v0"


def register_envs() -> list[str]:
    """Register every specenv environment id that is not registered yet (idempotent).

    Returns:
        The ids registered by this call (empty when all were already present).
    """
    added = []
    if REPLAY_ID not in gymnasium.registry:
        gymnasium.register(
            id=REPLAY_ID,
            entry_point="specenv.envs.replay:MoESpecEnv",
            vector_entry_point="specenv.envs.vector:MoESpecVectorEnv",
            kwargs={},
            nondeterministic=False,
            max_episode_steps=None,
        )
        added.append(REPLAY_ID)
    if LIVE_ID not in gymnasium.registry:
        gymnasium.register(
            id=LIVE_ID,
            entry_point="specenv.envs.live:MoESpecLiveEnv",
            kwargs={},
            nondeterministic=True,
            max_episode_steps=None,
        )
        added.append(LIVE_ID)
    return added
