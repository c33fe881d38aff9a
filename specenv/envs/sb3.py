"""Stable-Baselines3 adapter over the native vector environment (EnvPool's ``VecAdapter`` pattern).

SB3 does not accept a Gymnasium ``VectorEnv``; :class:`SB3VecEnv` wraps
:class:`specenv.envs.vector.MoESpecVectorEnv` as an SB3 ``VecEnv``:

* ``reset()`` returns only the observations (seeds set by ``seed()`` / options by
  ``set_options()`` are used once, as SB3 does: sub-environment i gets ``seed + i``);
* ``step_wait()`` returns ``obs, rewards, dones, infos`` with *same-step* autoreset: a finished
  sub-environment is reset at once (``reset_mask``), its last observation is kept in
  ``infos[i]["terminal_observation"]`` and ``infos[i]["TimeLimit.truncated"]`` is False (replay
  episodes end only by termination).

The trajectories equal those of SB3's ``DummyVecEnv`` over :class:`specenv.envs.replay.MoESpecEnv`
instances seeded the same way (a test checks it), at the speed of the native vector env. Wrap it in
``stable_baselines3.common.vec_env.VecMonitor`` to log episode returns.

This module imports stable-baselines3 (and so torch); ``import specenv`` does not import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvStepReturn
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("specenv.envs.sb3 needs stable-baselines3 (and torch): pip install 'specenv[rl]'") from exc

from specenv.envs.vector import MoESpecVectorEnv


class SB3VecEnv(VecEnv):
    """SB3 ``VecEnv`` view of a :class:`specenv.envs.vector.MoESpecVectorEnv`.

    Args:
        venv: The native vector environment (any autoreset state; the adapter resets finished
            sub-environments itself).
    """

    def __init__(self, venv: MoESpecVectorEnv):
        self.venv = venv
        self._actions: np.ndarray | None = None
        super().__init__(venv.num_envs, venv.single_observation_space, venv.single_action_space)

    # ------------------------------------------------------------------ core
    def reset(self) -> np.ndarray:
        """Reset every sub-environment; returns the (num_envs, dim) observations."""
        seeds = self._seeds
        seed: Any = None if all(s is None for s in seeds) else list(seeds)
        options = self._merge_options(self._options)
        obs, _ = self.venv.reset(seed=seed, options=options)
        self._reset_seeds()
        self._reset_options()
        return obs

    def _merge_options(self, options: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        if not any(options):
            return None
        keys = set().union(*(o.keys() for o in options))
        if keys - {"generation_id"}:
            raise ValueError(f"options: unknown key(s) {sorted(keys - {'generation_id'})} (supported: 'generation_id')")
        return {"generation_id": [o.get("generation_id") for o in options]}

    def step_async(self, actions: np.ndarray) -> None:
        """Store the actions for :meth:`step_wait`."""
        self._actions = np.asarray(actions).reshape(self.num_envs)

    def step_wait(self) -> VecEnvStepReturn:
        """Step all sub-environments, resetting the finished ones in the same step."""
        obs, reward, terminated, truncated, info = self.venv.step(self._actions)
        dones = terminated | truncated
        infos = _split_info(info, self.num_envs)
        for d, time_limit in zip(infos, (truncated & ~terminated).tolist(), strict=True):
            d["TimeLimit.truncated"] = time_limit
        if dones.any():
            for i in np.flatnonzero(dones).tolist():
                infos[i]["terminal_observation"] = obs[i].copy()
            obs, _ = self.venv.reset(options={"reset_mask": dones})
        return obs, reward.astype(np.float32), dones, infos

    def close(self) -> None:
        """Close the underlying vector environment."""
        self.venv.close()

    # ------------------------------------------------------------------ attributes
    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """The attribute of the (shared) vector environment, once per requested index."""
        value = getattr(self.venv, attr_name)
        return [value for _ in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Set an attribute of the shared vector environment (applies to all sub-environments)."""
        setattr(self.venv, attr_name, value)

    def env_method(
        self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **method_kwargs: Any
    ) -> list[Any]:
        """Call a method of the shared vector environment once; its result is repeated per index."""
        result = getattr(self.venv, method_name)(*method_args, **method_kwargs)
        return [result for _ in self._get_indices(indices)]

    def env_is_wrapped(self, wrapper_class: type, indices: VecEnvIndices = None) -> list[bool]:
        """No sub-environment is a wrapped gymnasium env."""
        return [False for _ in self._get_indices(indices)]

    def get_images(self) -> Sequence[np.ndarray | None]:
        """One ``(64, 128, 3)`` uint8 frame per sub-environment (the vector env made with ``render_mode="rgb_array"``).

        Raises:
            ValueError: If the vector environment does not render images.
        """
        if self.venv.render_mode != "rgb_array":
            raise ValueError(f"get_images needs render_mode='rgb_array' (the vector env has {self.venv.render_mode!r})")
        return list(self.venv.render())


def _split_info(info: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Gymnasium vector info (arrays + ``_key`` masks) to SB3's list of per-env dicts."""
    infos: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, val in info.items():
        if key.startswith("_"):
            continue
        mask = info.get("_" + key)
        values = val.tolist() if isinstance(val, np.ndarray) else list(val)
        if mask is None or mask.all():
            for d, v in zip(infos, values, strict=True):
                d[key] = v
        else:
            for i in np.flatnonzero(mask).tolist():
                infos[i][key] = values[i]
    return infos


def make_sb3_vec_env(num_envs: int = 8, seed: int | None = None, **env_kwargs: Any) -> SB3VecEnv:
    """A ready SB3 ``VecEnv`` of the replay environment.

    Args:
        num_envs: Number of sub-environments.
        seed: Seed for the next ``reset()`` (sub-environment i gets ``seed + i``), or None.
        **env_kwargs: ``dataset``, ``kmax``, ``split``, ``cost_model``, ``lookahead``,
            ``render_mode``, ``reward`` as for :class:`specenv.envs.replay.MoESpecEnv`.
    """
    venv = SB3VecEnv(MoESpecVectorEnv(num_envs=num_envs, **env_kwargs))
    if seed is not None:
        venv.seed(seed)
    return venv
