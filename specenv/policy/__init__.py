"""The policy contract shared by environments, benchmark and servers.

* :mod:`specenv.policy.base` -- the protocol every policy follows (``reset``, ``act``, ``act_batch``;
  batch policies add ``act_step``) and a base class with per-stream memory;
* :mod:`specenv.policy.mlp` -- the deployable numpy form (``policy.json`` + ``weights.npz``);
* :mod:`specenv.policy.registry` -- policies by registered name (entry-point group
  ``specenv.policies``) or by policy folder.
"""
