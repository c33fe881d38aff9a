"""The environments: replay (single and native vector), live, the SB3 adapter, and their registration.

``import specenv`` registers the ids (see :mod:`specenv.envs.registration`); the modules below load
only when an environment is made.

* :mod:`specenv.envs.replay` -- ``specenv/MoESpec-v1``, :class:`~specenv.envs.replay.MoESpecEnv`;
* :mod:`specenv.envs.vector` -- its native ``VectorEnv`` (``gymnasium.make_vec``);
* :mod:`specenv.envs.sequential` -- ``specenv/MoESpecSeq-v0``, one draft decision per step (sequential drafting);
* :mod:`specenv.envs.live` -- ``specenv/MoESpecLive-v1``, real rounds through an engine backend;
* :mod:`specenv.envs.sb3` -- the Stable-Baselines3 ``VecEnv`` adapter of the vector env.
"""
