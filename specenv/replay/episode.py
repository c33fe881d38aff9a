"""One replayed episode and its rounds: the round model of the replay environments, written once.

An :class:`Episode` is one generation of a split replayed round by round from the tables of a
:class:`specenv.replay.tables.ReplayData`. It holds the episode's state (generation, position t, first
row ``row0``, length N, prompt length L0, the acceptance uniforms, rounds played, cost so far) and
:meth:`Episode.play` executes one round of budget k and returns it as a :class:`Round`. The tables
a round reads (survival, charged cost, unique experts, AR step at the context) are a
:class:`RoundTables`, given explicitly: the episode's own, or, for one round, others (the joint
environment passes its capped tables).

The round model (:class:`specenv.envs.replay.MoESpecEnv`'s docstring):

* the draw: round r of the episode, budget k, accepts ``a = #{j <= k : u_r < P(a >= j | t)}`` drafts
  (the leading run: the survival is non-increasing in j) of its uniform u_r (the uniforms are drawn
  at the start: :func:`draw`), or a recorded verdict (:attr:`RoundTables.accepted`);
* the charge/commit rule, :func:`settle`: ``committed = min(a + 1, N - t)`` (then ``accepted =
  committed - 1``: nothing is accepted past the end), charged
  ``C(t, k)`` (the row verified at and the budget, whatever was accepted), in units of the reward
  unit and of the AR step at the row's context; ``t' = t + committed``; the episode terminates
  when ``t' >= N``.

:func:`settle` is the one definition of that rule: :meth:`Episode.play` calls it on Python scalars,
the vector environment (:mod:`specenv.envs.vector`) on arrays of many episodes (with
``numpy.minimum`` and ``take``), the same operations in the same order, hence bit-identical figures.

The observation is not the episode's: the environment folds each :class:`Round` into its own
observation state (``obs.update(r.k, r.accepted, r.U_r, r.ctx_units, r.committed)`` in the replay
environments; the batch environment folds in its step's cost instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

#: A :class:`specenv.replay.tables.ReplayData` (not imported: the module stays numpy only, so that the batch
#: bound of :mod:`oracle` can share :func:`draw` without importing the observation's Gymnasium spaces).
ReplayData = Any

__all__ = ["Episode", "Round", "RoundTables", "draw", "settle"]


class Round(NamedTuple):
    """One verification round, as :func:`settle` returns it.

    From :meth:`Episode.play` every field is a Python scalar; from the vector environment every
    field is an array over its sub-environments.

    Attributes:
        k: The budget (drafts verified).
        t: The position the round verified at (tokens committed before it).
        accepted: Accepted drafts, capped at the generation's end (``committed - 1``).
        committed: Tokens committed, ``accepted + 1``.
        t_next: Tokens committed after the round, ``t + committed``.
        cost_ms: The charged cost C(t, k) in ms.
        U_r: The unique experts U_{t,k} of the round.
        units: ``cost_ms`` in reward units (the mean AR step of the split, ``ar_unit_ms``).
        ctx_units: ``cost_ms`` in AR steps at the round's context (the observation's ``prev_cost``).
        terminated: True when the round committed the generation's last token.
    """

    k: Any
    t: Any
    accepted: Any
    committed: Any
    t_next: Any
    cost_ms: Any
    U_r: Any
    units: Any
    ctx_units: Any
    terminated: Any


def settle(
    k: Any,
    t: Any,
    accepted: Any,
    N: Any,
    row: Any,
    width: int,
    cost_at: Callable[[Any], Any],
    U_at: Callable[[Any], Any],
    ctx_at: Callable[[Any], Any],
    unit_ms: float,
    minimum: Callable[[Any, Any], Any] = min,
) -> Round:
    """The charge/commit rule of a round (module docstring), on scalars or on arrays.

    Args:
        k: Budget(s).
        t: Position(s) verified at.
        accepted: Drafts the target accepted of the k verified (0..k), before the end cap.
        N: Generation length(s).
        row: Table row(s) of position t (``offsets[g] + t``).
        width: Columns of the per-budget tables (kmax + 1).
        cost_at: Charged cost C at a flat (row, k) index ``row * width + k`` (``ndarray.item`` for a
            scalar, ``ravel().take`` for arrays).
        U_at: Unique experts at a flat (row, k) index.
        ctx_at: AR step at the context of a row.
        unit_ms: The reward unit (ms).
        minimum: ``min`` for scalars, ``numpy.minimum`` for arrays.

    Returns:
        The :class:`Round`.
    """
    committed = minimum(accepted + 1, N - t)
    j = row * width + k
    cost = cost_at(j)
    t_next = t + committed
    # tuple.__new__: Round's own __new__ is a Python function, twice as slow, on every step of an env
    return _new_round(
        Round, (k, t, committed - 1, committed, t_next, cost, U_at(j), cost / unit_ms, cost / ctx_at(row), t_next >= N)
    )


_new_round = tuple.__new__


def draw(
    rng: np.random.Generator, lengths: Any, generation: int | None = None, out: np.ndarray | None = None
) -> tuple[int, np.ndarray]:
    """The random draws of an episode: its generation index, then its acceptance uniforms.

    ``g = rng.integers(G)`` unless ``generation`` is given, then ``u = rng.random(N_g)`` (one uniform
    per round). Every replay (the single, per-token, vector, caps and batch environments, the batch
    bound's requests) draws this way, so one seed replays the same episode everywhere.

    Args:
        rng: The episode's generator (after seeding).
        lengths: (G,) positions N of each generation of the split.
        generation: A generation index to replay instead of drawing one.
        out: A contiguous float64 buffer of at least ``max(lengths)`` entries to draw the uniforms
            into (the same numbers; ``u`` is then its first N_g entries).

    Returns:
        ``(g, u)``.
    """
    g = int(rng.integers(len(lengths))) if generation is None else int(generation)
    n = int(lengths[g])
    return g, rng.random(n) if out is None else rng.random(n, out=out[:n])


@dataclass(frozen=True, eq=False)
class RoundTables:
    """The tables a replayed round reads; row ``offsets[g] + t`` of the split, column = budget k.

    Exactly one of ``survival`` (a drawn acceptance) and ``accepted`` (a recorded verdict) is given.

    Attributes:
        cost: (n, kmax+1) charged cost C(t, k) in ms.
        U: (n, kmax+1) unique experts U_{t,k}.
        ar_ctx: (n,) AR step at the row's context (the unit of the observation's ``prev_cost``).
        survival: (n, kmax+1) ``P(a >= j)`` in column j-1 and 0 in the last column
            (:attr:`specenv.replay.tables.ReplayData.survival`): the round accepts the leading drafts with
            ``u < P(a >= j)``.
        accepted: (n, kmax+1) integer drafts accepted at budget k (a deterministic verdict, such as a
            capped target's recorded one); the round's uniform is not used.
    """

    cost: np.ndarray
    U: np.ndarray
    ar_ctx: np.ndarray
    survival: np.ndarray | None = None
    accepted: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (self.survival is None) == (self.accepted is None):
            raise ValueError("RoundTables: give exactly one of survival and accepted")
        shape = self.cost.shape
        for name in ("U", "survival", "accepted"):
            x = getattr(self, name)
            if x is not None and x.shape != shape:
                raise ValueError(f"RoundTables.{name}: shape {x.shape}, expected {shape} (cost's)")
        if self.ar_ctx.shape != shape[:1]:
            raise ValueError(f"RoundTables.ar_ctx: shape {self.ar_ctx.shape}, expected {shape[:1]}")

    @classmethod
    def of(cls, data: ReplayData) -> RoundTables:
        """The uncapped tables of a replay: survival, charged cost, U and AR step at the context."""
        return cls(cost=data.cost, U=data.U, ar_ctx=data.ar_ctx_ms, survival=data.survival)


class Episode:
    """One replayed generation of a split, played round by round (module docstring).

    Build it with :meth:`start` (draws from a generator as every replay does). The figures of the
    episode are read-only attributes and properties; only :meth:`play` advances it.

    Args:
        data: The replay tables (lengths, offsets, prompt lengths, AR totals).
        g: Generation index in the split.
        uniforms: (N,) acceptance uniforms, one per round.
        tables: The tables of its rounds (default ``RoundTables.of(data)``).
        unit_ms: The reward unit of :attr:`Round.units` (default ``data.ar_unit_ms``).

    Attributes:
        data: The replay tables.
        tables: The episode's round tables.
        unit_ms: The reward unit.
        generation: Generation index g in the split.
        generation_id: Its id.
        category: Its category.
        row0: Table row of position 0.
        N: Its length (positions).
        L0: Context length at t = 0 (prompt length).
    """

    __slots__ = (
        "data",
        "tables",
        "unit_ms",
        "generation",
        "generation_id",
        "category",
        "row0",
        "N",
        "L0",
        "_t",
        "_rounds",
        "_cost_ms",
        "_u",
        "_width",
        "_surv",
        "_cost",
        "_U",
        "_ctx",
    )

    def __init__(
        self,
        data: ReplayData,
        g: int,
        uniforms: np.ndarray,
        tables: RoundTables | None = None,
        unit_ms: float | None = None,
    ):
        self.data = data
        self.tables = tables = RoundTables.of(data) if tables is None else tables
        if tables.survival is None:
            raise ValueError("Episode: its own tables draw the acceptance (survival); pass a verdict per round")
        self.unit_ms = data.ar_unit_ms if unit_ms is None else float(unit_ms)
        self.generation = g
        self.generation_id = int(data.generation_ids[g])
        self.category = str(data.categories[g])
        self.row0 = int(data.offsets[g])
        self.N = int(data.lengths[g])
        self.L0 = int(data.L0[g])
        if len(uniforms) < self.N:
            raise ValueError(f"Episode: {len(uniforms)} uniforms for {self.N} positions")
        self._u = uniforms.item
        self._t = 0
        self._rounds = 0
        self._cost_ms = 0.0
        self._width = tables.cost.shape[1]
        # scalar accessors on flat indices (.item returns Python scalars: the arithmetic of floats)
        self._surv = tables.survival.item
        self._cost = tables.cost.item
        self._U = tables.U.item
        self._ctx = tables.ar_ctx.item

    @classmethod
    def start(
        cls,
        data: ReplayData,
        rng: np.random.Generator,
        generation_id: Any = None,
        tables: RoundTables | None = None,
        unit_ms: float | None = None,
    ) -> Episode:
        """Begin an episode with the draws of :func:`draw` (the generation unless ``generation_id`` names one).

        Raises:
            ValueError: If ``generation_id`` is not in the split.
        """
        g = None if generation_id is None else data.index_of(generation_id)
        g, u = draw(rng, data.lengths, g)
        return cls(data, g, u, tables, unit_ms)

    # ------------------------------------------------------------------ state
    @property
    def t(self) -> int:
        """Tokens committed so far."""
        return self._t

    @property
    def row(self) -> int:
        """Table row of the current position, ``row0 + t``."""
        return self.row0 + self._t

    @property
    def rounds(self) -> int:
        """Rounds played."""
        return self._rounds

    @property
    def cost_ms(self) -> float:
        """Charged cost of the rounds played (ms)."""
        return self._cost_ms

    @property
    def done(self) -> bool:
        """True once the N tokens are committed."""
        return self._t >= self.N

    # ------------------------------------------------------------------ the round
    def play(self, k: int, tables: RoundTables | None = None) -> Round:
        """Execute one round of budget ``k`` (0..kmax) at the current position and advance.

        Args:
            k: The budget.
            tables: The tables of this round (default the episode's own); with a verdict
                (:attr:`RoundTables.accepted`) the round accepts that many drafts.

        Raises:
            RuntimeError: If the episode is done.
        """
        t = self._t
        N = self.N
        if t >= N:
            raise RuntimeError("Episode.play: the episode is done")
        row = self.row0 + t
        width = self._width
        if tables is None:
            u = self._u(self._rounds)
            surv = self._surv
            j = row * width
            a = 0
            while a < k and u < surv(j + a):
                a += 1
            r = settle(k, t, a, N, row, width, self._cost, self._U, self._ctx, self.unit_ms)
        else:
            if tables.cost.shape != self.tables.cost.shape:
                raise ValueError(
                    f"Episode.play: tables of shape {tables.cost.shape}, the episode's are {self.tables.cost.shape}"
                )
            if tables.survival is not None:
                u = self._u(self._rounds)
                surv = tables.survival.item
                j = row * width
                a = 0
                while a < k and u < surv(j + a):
                    a += 1
            else:
                a = tables.accepted.item(row * width + k)
            r = settle(k, t, a, self.N, row, width, tables.cost.item, tables.U.item, tables.ar_ctx.item, self.unit_ms)
        self._t = r[4]  # t_next
        self._rounds += 1
        self._cost_ms += r[5]  # cost_ms
        return r

    def info(self, r: Round) -> dict[str, Any]:
        """A replay environment's ``step`` info of round ``r`` (just played), with the totals when it terminated.

        Keys: ``k``, ``accepted``, ``committed``, ``cost_ms``, ``U_r``, ``L`` (context verified at),
        ``t`` (after the round), ``generation_id``, ``category``; at the end also ``speedup`` (AR cost /
        episode cost), ``episode_cost_ms``, ``ar_cost_ms`` and ``rounds``.
        """
        k, t, accepted, committed, t_next, cost, U_r, _, _, terminated = r
        info = {
            "k": k,
            "accepted": accepted,
            "committed": committed,
            "cost_ms": cost,
            "U_r": U_r,
            "L": self.L0 + t,
            "t": t_next,
            "generation_id": self.generation_id,
            "category": self.category,
        }
        if terminated:
            ar = float(self.data.ar_total_ms[self.generation])
            info["speedup"] = ar / self._cost_ms
            info["episode_cost_ms"] = self._cost_ms
            info["ar_cost_ms"] = ar
            info["rounds"] = self._rounds
        return info
