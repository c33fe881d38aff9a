"""specenv: speculation-length control on Mixture-of-Experts models as a Gymnasium environment.

Importing the package registers its environments with Gymnasium (idempotently), so
``gymnasium.make("specenv/MoESpec-v0")`` works after ``import specenv``.
"""

__version__ = "0.1.0"

from specenv.envs.registration import register_envs as _register_envs

_register_envs()
