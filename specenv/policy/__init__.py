"""The policy contract shared by environments, benchmark and servers.

* :mod:`specenv.policy.base` -- the one protocol every policy follows (``reset``, ``act(obs, ids, step)``
  on a batch of observations, optional ``release``), the batch-level record ``BatchStep``, the adapter
  of the batch environment's flat observation, and a base class with per-stream memory;
* :mod:`specenv.policy.mlp` -- the deployable numpy form (``policy.json`` + ``weights.npz``);
* :mod:`specenv.policy.registry` -- policies by registered name (entry-point group
  ``specenv.policies``) or by policy folder.
"""
