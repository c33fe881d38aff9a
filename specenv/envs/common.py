"""What the single-stream environments (replay and live) share: argument checks and rendering.

:class:`RoundEnv` is the base of :class:`specenv.envs.replay.MoESpecEnv` and
:class:`specenv.envs.live.MoESpecLiveEnv`: the action check of ``step``, the ``options`` of
``reset`` and ``render``. :data:`REWARDS` / :data:`DEFAULT_REWARD` / :func:`check_reward` are the
reward options of every environment, the vector one included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np

from specenv.envs.render import RoundStrip

if TYPE_CHECKING:
    from specenv.replay.episode import Episode

#: Reward options: ``"cost"`` = -cost / ar_unit_ms; ``"savings"`` = that + the tokens the round committed.
REWARDS = ("cost", "savings")
#: The environments' default reward (the v1 ids; the v0 ids pass ``reward="cost"``). The savings
#: return is N minus the episode cost in AR units, the cost return minus that cost: they differ by
#: the generation's length N, a constant whatever the policy does, so both have the same optimum.
DEFAULT_REWARD = "savings"


def check_reward(reward: str) -> bool:
    """Validate a ``reward`` argument; True for ``"savings"``.

    Raises:
        ValueError: Naming the argument when it is not one of :data:`REWARDS`.
    """
    if reward not in REWARDS:
        raise ValueError(f"reward={reward!r}: expected one of {REWARDS}")
    return reward == "savings"


def reset_generation_id(options: dict[str, Any] | None) -> Any:
    """The ``generation_id`` of ``reset(options=...)`` (None when absent).

    Raises:
        ValueError: For an unknown option key.
    """
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise ValueError(f"options={options!r}: must be a dict (supported key: 'generation_id')")
    unknown = set(options) - {"generation_id"}
    if unknown:
        raise ValueError(f"options: unknown key(s) {sorted(unknown)} (supported: 'generation_id')")
    return options.get("generation_id")


class RoundEnv(gym.Env[np.ndarray, np.int64]):
    """Base of the single-stream environments: one generation per episode, one round per step.

    Subclasses set ``kmax``, ``render_mode``, ``_done``, ``_line`` (the ansi line) and ``_strip``
    (a :class:`specenv.envs.render.RoundStrip` when ``render_mode="rgb_array"``), and the class
    attribute ``env_id`` used in messages. The replay ones also set ``_obs`` (their
    :class:`specenv.observation.single.ScalarObservation`) and start each episode with :meth:`_begin`.
    """

    env_id = ""
    kmax: int
    _done: bool = True
    _line: str = ""
    _strip: RoundStrip | None = None
    _episode: Episode | None = None

    def _begin(self, episode: Episode) -> Episode:
        """Make ``episode`` (just started) the one in progress: clear the observation state and the render."""
        self._episode = episode
        self._done = False
        self._obs.reset()
        self._line = f"gen {episode.generation_id} [{episode.category}] t=0"
        if self._strip is not None:
            self._strip.clear()
        return episode

    def _check_action(self, action: Any) -> int:
        """The budget of ``step(action)`` as an int.

        Raises:
            ValueError: If ``action`` is not an integer in 0..kmax.
            RuntimeError: If called before :meth:`reset` or after the episode ended.
        """
        try:
            k = action.__index__()
        except (AttributeError, TypeError):
            raise ValueError(f"action={action!r}: must be an integer in 0..{self.kmax}") from None
        if not 0 <= k <= self.kmax:
            raise ValueError(f"action={k}: outside 0..{self.kmax}")
        if self._done:
            raise RuntimeError("step() called before reset() or after the episode ended; call reset()")
        return k

    def render(self) -> str | np.ndarray | None:
        """The recent rounds: one line of text (``"ansi"``) or a ``(64, 128, 3)`` uint8 image (``"rgb_array"``).

        Returns None (with a warning) when the environment was made without a render mode.
        """
        if self.render_mode is None:
            gym.logger.warn(
                "You are calling render method without specifying any render mode. "
                f'Create the environment with render_mode="ansi" or "rgb_array", '
                f'e.g. gym.make("{self.env_id}", render_mode="rgb_array")'
            )
            return None
        if self._strip is not None:
            return self._strip.frames()[0]
        return self._line
