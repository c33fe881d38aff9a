"""The oracle as a policy: the exact SSP oracle's optimal budget k*(t), played in the replay environment.

The oracle (:func:`oracle.dp.solve`) gives an optimal budget for every position t of every
generation of a split. Its decision depends on the state (which generation, how many tokens are
committed), not on the observation vector: the observation hides N, rho and the generation's
identity, so an observation-only policy cannot reproduce it. :class:`OracleExpert` is therefore a
*privileged* expert: :meth:`OracleExpert.act_state` takes the generation id and position the replay
environment reports (``reset`` info ``generation_id``, step info ``t``); in the one policy protocol
(:mod:`specenv.policy.base`) those pairs are its stream ids, ``act(obs, ids=[(generation_id, t), ...])``
(the observations are not read; a server, which has no replay state, refuses it). It is what the Minari export
(:mod:`policies.learn.offline`) records as expert data for offline RL and behaviour cloning
(:mod:`policies.learn.bc`), and DAgger's beta = 1 iteration (:mod:`policies.learn.imitation`) plays the same
k*(t).

The oracle is solved on the environment's own positions table (the split, kmax) with the
environment's own cost model and drafting charge, so its budgets are optimal for exactly the episodes
the environment plays: drafting ``"none"`` and ``"sequential"`` share the bound of ``"none"``,
``"block"`` with h > 0 pays T_D(max(k, h)) (DESIGN.md section 1).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from specenv.cost.model import CostModel
from specenv.policy.base import BatchStep
from specenv.traces.traceset import PositionArrays

#: The policy name of the oracle expert (``specenv export minari --policy oracle``).
ORACLE_POLICY = "oracle"


class OracleExpert:
    """The oracle's optimal budget k*(t) for a replay environment's split (a privileged policy).

    Args:
        arrays: The split's positions in the environment's order (row = ``offsets[g] + t``;
            :func:`policies.learn.imitation.split_arrays`).
        cost_model: The environment's cost model (``env.unwrapped.data.cost_model``).
        lookahead: The environment's lookahead h.
        drafting: The environment's drafting mode.
    """

    name = ORACLE_POLICY
    privileged = True
    #: Why a server refuses it (``specenv.engines.vllm.settings.policy_refusal``).
    unservable = "privileged: it reads the replay's generation and position, which a server does not have"

    def __init__(self, arrays: PositionArrays, cost_model: CostModel, lookahead: int = 0, drafting: str = "none"):
        from oracle.dp import solve

        self.arrays = arrays
        self.drafting = drafting
        self.lookahead = int(lookahead)
        self.solution = solve(arrays, cost_model, lookahead=self.lookahead, drafting=drafting)
        self.k_star = np.asarray(self.solution.k, dtype=np.int64)
        self._index = {int(g): i for i, g in enumerate(arrays.generation_ids)}

    @classmethod
    def for_env(cls, env: Any) -> OracleExpert:
        """The oracle of a replay environment built with ``gymnasium.make`` (its split, kmax, cost model, drafting).

        Args:
            env: The replay environment (``specenv/MoESpec-v1``), wrapped or not; its trace set is read
                again for the positions table.
        """
        from policies.learn.imitation import split_arrays

        data = env.unwrapped.data
        arrays = split_arrays(data.dataset, data.kmax, data.split)
        return cls(arrays, data.cost_model, lookahead=data.lookahead, drafting=data.drafting)

    @property
    def table_sha256(self) -> str:
        """sha256 of the k*(t) table (int64 bytes, row order): the fingerprint of this expert."""
        return hashlib.sha256(np.ascontiguousarray(self.k_star).tobytes()).hexdigest()

    @property
    def speedup_pooled(self) -> float:
        """The split's S_max (pooled AR cost / optimal expected cost)."""
        return float(self.solution.speedup_pooled)

    def reset(self) -> None:
        """Nothing to forget: k*(t) depends on the state only."""

    def act(self, obs: np.ndarray, ids: Sequence[Hashable] | None = None, step: BatchStep | None = None) -> Any:
        """k*(t) of every row, ``ids`` the rows' replay states ``(generation_id, t)`` (``obs`` is not read).

        A 1-D observation is a batch of one (``ids`` then holds its one pair) and gives one int.

        Raises:
            ValueError: Without ids (a privileged policy needs the replay state), or as :meth:`act_state`.
        """
        if ids is None:
            raise ValueError("oracle expert: privileged, pass ids=[(generation_id, t), ...] (the replay state)")
        ks = np.array([self.act_state(int(g), int(t)) for g, t in ids], dtype=np.int64)  # type: ignore[misc]
        return int(ks[0]) if np.ndim(obs) == 1 else ks

    def act_state(self, generation_id: int, t: int) -> int:
        """k*(t) of a generation at position t (the tokens already committed).

        Raises:
            ValueError: For a generation outside the split or a position outside 0..N-1.
        """
        g = self._index.get(int(generation_id))
        if g is None:
            raise ValueError(f"oracle expert: generation {generation_id} is not in the solved split")
        lo, hi = int(self.arrays.offsets[g]), int(self.arrays.offsets[g + 1])
        if not 0 <= t < hi - lo:
            raise ValueError(f"oracle expert: position t={t} outside 0..{hi - lo - 1} of generation {generation_id}")
        return int(self.k_star[lo + int(t)])
