"""specenv: speculation-length control on Mixture-of-Experts models as a Gymnasium environment.

Importing the package registers its environments with Gymnasium (idempotently), so
``gymnasium.make("specenv/MoESpec-v1")`` works after ``import specenv``; Gymnasium itself is
imported only by whoever uses it (registration waits for it, see :mod:`specenv.envs.registration`).
"""

__version__ = "0.1.0"

from specenv.envs.registration import register_when_imported as _register_when_imported

_register_when_imported()
