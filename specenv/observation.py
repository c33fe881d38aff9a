"""The observation contract: what a real server knows before it verifies a round.

One implementation, vectorised over a batch of independent streams (generations/requests), is shared
by the replay environment (batch of 1), its native vector form, the live engines and the vLLM
controller, so a policy sees the same features everywhere.

Layout of the float32 vector (``ObservationSpec.names`` gives the names in order):

======================  ===============================================================  =========
name                    meaning and scaling                                              range
======================  ===============================================================  =========
context                 L_t / 4096 (context length; 4096 = the paper's max_model_len)    [0, 64]
progress                t / max_new_tokens (tokens generated so far, clipped)            [0, 1]
prev_k                  previous round's budget k / kmax (0 before the first round)      [0, 1]
prev_accepted           previous round's accepted drafts / kmax                          [0, 1]
prev_U                  previous round's observed U_r / n_experts                        [0, 1]
prev_cost               previous round's cost in mean-AR-step units / (kmax + 1)         [0, 16]
acc_rate                EMA of accepted/k over rounds with k >= 1 (prior 0.5)            [0, 1]
acc_len                 EMA of accepted/kmax over rounds with k >= 1 (prior 0)           [0, 1]
cost_per_token          EMA of round cost per committed token, AR units (prior 1)        [0, 16]
first_round             1 on a generation's first round, else 0                          [0, 1]
acc_depth_1..kmax       EMA of the conditional acceptance at draft depth j, updated      [0, 1]
                        on rounds that reached depth j (k >= j, accepted >= j-1);
                        prior 0.5
conf_1..h               the draft's confidence q_{t,j} of its next h tokens (only when   [0, 1]
                        lookahead h > 0; drafting max(k, h) tokens is then charged)
======================  ===============================================================  =========

Nothing of the current round's acceptance or routing, nor the generation's length N, nor any
future position enters the vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gymnasium import spaces

CONTEXT_SCALE = 4096.0
EMA = 0.8  # weight of the old value in every running statistic
PRIOR_RATE = 0.5


@dataclass(frozen=True)
class ObservationSpec:
    """Shape and scaling of the observation vector.

    Attributes:
        kmax: Largest budget (action space is 0..kmax).
        lookahead: Number h of draft confidences exposed (0 = none).
        max_new_tokens: Generation cap used to scale ``progress``.
        n_experts: Experts per layer, to scale ``prev_U``.
    """

    kmax: int
    lookahead: int = 0
    max_new_tokens: int = 1000
    n_experts: int = 128

    @property
    def names(self) -> list[str]:
        """Feature names in vector order."""
        base = [
            "context",
            "progress",
            "prev_k",
            "prev_accepted",
            "prev_U",
            "prev_cost",
            "acc_rate",
            "acc_len",
            "cost_per_token",
            "first_round",
        ]
        return (
            base
            + [f"acc_depth_{j}" for j in range(1, self.kmax + 1)]
            + [f"conf_{j}" for j in range(1, self.lookahead + 1)]
        )

    @property
    def dim(self) -> int:
        """Length of the vector."""
        return 10 + self.kmax + self.lookahead

    def index(self, name: str) -> int:
        """Position of a named feature."""
        return self.names.index(name)

    def high(self) -> np.ndarray:
        """Upper bounds of the Box."""
        hi = np.ones(self.dim, dtype=np.float32)
        hi[0] = 64.0
        hi[5] = 16.0
        hi[8] = 16.0
        return hi

    def space(self) -> spaces.Box:
        """The single-stream observation space."""
        return spaces.Box(low=np.zeros(self.dim, dtype=np.float32), high=self.high(), dtype=np.float32)


class ObservationState:
    """Running statistics of a batch of streams, and the observation builder.

    Args:
        spec: The observation layout.
        n: Number of streams.
    """

    def __init__(self, spec: ObservationSpec, n: int = 1):
        self.spec = spec
        self.n = n
        self.prev_k = np.zeros(n)
        self.prev_acc = np.zeros(n)
        self.prev_U = np.zeros(n)
        self.prev_cost = np.zeros(n)
        self.acc_rate = np.full(n, PRIOR_RATE)
        self.acc_len = np.zeros(n)
        self.cost_per_token = np.ones(n)
        self.first = np.ones(n)
        self.acc_depth = np.full((n, spec.kmax), PRIOR_RATE)
        self._hi = spec.high()

    def reset(self, mask: np.ndarray | None = None) -> None:
        """Forget the history of the streams in ``mask`` (all when None)."""
        m = slice(None) if mask is None else np.asarray(mask, dtype=bool)
        self.prev_k[m] = 0.0
        self.prev_acc[m] = 0.0
        self.prev_U[m] = 0.0
        self.prev_cost[m] = 0.0
        self.acc_rate[m] = PRIOR_RATE
        self.acc_len[m] = 0.0
        self.cost_per_token[m] = 1.0
        self.first[m] = 1.0
        self.acc_depth[m] = PRIOR_RATE

    def update(
        self,
        k: np.ndarray,
        accepted: np.ndarray,
        U_r: np.ndarray,
        cost_units: np.ndarray,
        committed: np.ndarray,
        mask: np.ndarray | None = None,
    ) -> None:
        """Fold one executed round per stream into the statistics.

        Args:
            k: Budgets used.
            accepted: Accepted drafts.
            U_r: Observed unique experts of the verification pass.
            cost_units: Round cost in mean-AR-step units.
            committed: Tokens committed by the round (accepted + 1, capped at the end).
            mask: Streams to update (all when None).
        """
        sel = np.ones(self.n, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        k = np.asarray(k, dtype=np.float64)
        a = np.asarray(accepted, dtype=np.float64)
        spec_round = sel & (k >= 1)
        self.prev_k[sel] = k[sel]
        self.prev_acc[sel] = a[sel]
        self.prev_U[sel] = np.asarray(U_r, dtype=np.float64)[sel]
        self.prev_cost[sel] = np.asarray(cost_units, dtype=np.float64)[sel]
        self.first[sel] = 0.0
        ratio = np.divide(a, k, out=np.zeros_like(a), where=k > 0)
        self.acc_rate[spec_round] = EMA * self.acc_rate[spec_round] + (1 - EMA) * ratio[spec_round]
        self.acc_len[spec_round] = EMA * self.acc_len[spec_round] + (1 - EMA) * (a[spec_round] / self.spec.kmax)
        cpt = np.asarray(cost_units, dtype=np.float64) / np.maximum(np.asarray(committed, dtype=np.float64), 1.0)
        self.cost_per_token[sel] = EMA * self.cost_per_token[sel] + (1 - EMA) * cpt[sel]
        # depth j (1-based) was tried when k >= j and the first j-1 drafts were accepted
        j = np.arange(1, self.spec.kmax + 1)[None, :]
        reached = sel[:, None] & (k[:, None] >= j) & (a[:, None] >= j - 1)
        success = (a[:, None] >= j).astype(np.float64)
        self.acc_depth = np.where(reached, EMA * self.acc_depth + (1 - EMA) * success, self.acc_depth)

    def build(self, L: np.ndarray, t: np.ndarray, conf: np.ndarray | None = None) -> np.ndarray:
        """The (n, dim) float32 observations at context ``L`` after ``t`` generated tokens.

        Args:
            L: Context lengths L_t.
            t: Tokens generated so far.
            conf: (n, lookahead) draft confidences of the next drafts (required iff lookahead > 0).
        """
        s = self.spec
        obs = np.empty((self.n, s.dim), dtype=np.float32)
        obs[:, 0] = np.asarray(L, dtype=np.float64) / CONTEXT_SCALE
        obs[:, 1] = np.minimum(np.asarray(t, dtype=np.float64) / s.max_new_tokens, 1.0)
        obs[:, 2] = self.prev_k / s.kmax
        obs[:, 3] = self.prev_acc / s.kmax
        obs[:, 4] = self.prev_U / s.n_experts
        obs[:, 5] = self.prev_cost / (s.kmax + 1)
        obs[:, 6] = self.acc_rate
        obs[:, 7] = self.acc_len
        obs[:, 8] = self.cost_per_token
        obs[:, 9] = self.first
        obs[:, 10 : 10 + s.kmax] = self.acc_depth
        if s.lookahead:
            if conf is None:
                raise ValueError("conf is required when lookahead > 0")
            obs[:, 10 + s.kmax :] = conf
        np.clip(obs, 0.0, self._hi, out=obs)
        return obs
