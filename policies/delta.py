"""The seed paper's delta-space rule: pick the k maximising lambda * E[a(k)] - E[C(k)].

Source: "The Limits of Speculation" (Amankulov & Mamatin, 2026), Section "Delta Space" / Figure 3:
at the Oracle's choice k*, rejected candidates lie on a line dE[Cost] = lambda * dE[a] through the
origin, i.e. k* satisfies the marginal condition of the SSP, k* = argmax_k lambda*E[a(k)] - E[C(k)],
with lambda the value function's marginal cost per committed token.

Online estimates (nothing from the trace):

* E[a(k)] = sum_{i<=k} prod_{j<=i} rho_hat_j, with rho_hat_j the running conditional acceptance at
  depth j (:class:`policies.heuristics.AcceptanceEstimator`: forgetting-weighted counts of the
  generation's rounds with a prior, by default the train split's mean rho per depth); when the
  draft's confidences are observed (lookahead), rho_hat_j for those depths is the mean of the
  running estimate and the confidence.
* E[C(k)] = the cost model at the current context with U(k) predicted from running per-k means of
  observed U (:class:`policies.heuristics.UPredictor`).
* lambda: fitted by the oracle on the train split (:func:`oracle.boundary_slope`, ms per accepted
  token), or, in the adaptive variant, the running model cost per committed token of the
  generation so far (starting from the AR step cost), which needs no oracle.
"""

from __future__ import annotations

import numpy as np

from policies.heuristics import AcceptanceEstimator, _CostAware
from specenv.cost.model import CostModel
from specenv.observation.single import ObservationSpec
from specenv.traces.traceset import expected_accepted_table


class DeltaSpaceRule(_CostAware):
    """k* = argmax_k lambda * E[a(k)] - E[C(k)] from online estimates.

    Args:
        spec: Observation layout.
        cost_model: The server's cost model.
        lam_ms: lambda in ms per accepted token (required unless ``adaptive``).
        adaptive: Estimate lambda online as the running cost per committed token.
        u_prior: Prior U(k) per budget (e.g. train-split means).
        rho_prior: Prior conditional acceptance per depth (e.g. train-split means of rho).
        use_conf: Blend observed draft confidences into rho_hat.
    """

    def __init__(
        self,
        spec: ObservationSpec,
        cost_model: CostModel,
        lam_ms: float | None = None,
        adaptive: bool = False,
        u_prior: np.ndarray | None = None,
        rho_prior: np.ndarray | None = None,
        use_conf: bool = True,
    ):
        if not adaptive and (lam_ms is None or not np.isfinite(lam_ms) or lam_ms <= 0):
            raise ValueError("lam_ms must be a positive number unless adaptive=True")
        self.lam_ms = lam_ms
        self.adaptive = adaptive
        self.use_conf = use_conf
        self.rho_prior = rho_prior
        self.name = "delta-space-adaptive" if adaptive else "delta-space"
        super().__init__(spec, cost_model, u_prior)

    def _reset_state(self) -> None:
        super()._reset_state()
        self.acc = AcceptanceEstimator(self.spec.kmax, self.rho_prior)
        self.cost_sum = 0.0
        self.tok_sum = 0.0
        self.prev_L = None

    def expected_accepted(self, obs: np.ndarray) -> np.ndarray:
        """(kmax+1,) E[a(k)] from the online acceptance estimates."""
        rho = self.acc.rho()
        if self.use_conf and self.spec.lookahead:
            conf = self.view.conf(obs)
            h = min(len(conf), len(rho))
            rho[:h] = 0.5 * (rho[:h] + conf[:h])
        return expected_accepted_table(rho)

    def lam(self, obs: np.ndarray) -> float:
        """Current lambda in ms per accepted token."""
        if not self.adaptive:
            return float(self.lam_ms)  # type: ignore[arg-type]
        if self.tok_sum <= 0:
            return float(self.cost_model.ar_ms(self.view.L(obs)))
        return self.cost_sum / self.tok_sum

    def _act(self, obs: np.ndarray) -> int:
        self._observe(obs)
        if not self.view.first_round(obs):
            self.acc.observe(self.view.prev_k(obs), self.view.prev_accepted(obs))
        L = self.view.L(obs)
        if self.adaptive and not self.view.first_round(obs) and self.prev_L is not None:
            k = self.view.prev_k(obs)
            self.cost_sum += float(self.cost_model.round_ms(k, self.view.prev_U(obs), self.prev_L))
            self.tok_sum += self.view.prev_accepted(obs) + 1
        self.prev_L = L
        score = self.lam(obs) * self.expected_accepted(obs) - self._round_ms(obs)
        return int(np.argmax(score))
