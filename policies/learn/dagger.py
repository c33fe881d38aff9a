"""The DAgger loop: roll in with a mixture of expert and learner, aggregate labelled states, refit, repeat.

One loop (:func:`run_dagger`) serves every imitation learner of the project; what differs between
them is composed from three parts:

* an *episode source* (:class:`ReplayEpisodes` for the single-request, sequential and joint (k, cap)
  environments, one episode per train generation; the batch environment's own source in
  :mod:`policies.batch.learn`) plays the mixture in an environment and returns the visited states
  (:class:`Visits`);
* an *expert* (:class:`TableExpert`: a table of budgets per position row, and a labelling function)
  says what it would play in a visited state and turns one iteration's visits into training pairs
  (observation, cost-sensitive labels: the regret of every action, in AR steps). An expert whose
  labels depend on the learner (approximate policy iteration) relabels the whole aggregate after
  each fit (:meth:`TableExpert.update`);
  Which table of the split the expert is solved and labels on is :func:`expert_arrays`'s choice:
  the true acceptances (``"oracle"``: the clairvoyant SSP oracle, whose k* and action values know
  which drafts a greedy trace accepts) or a train-split calibration's (``"belief"``: the belief
  oracle of :mod:`oracle.belief`, whose action values are the cost-to-go of the SSP on the
  acceptance probabilities the draft's signals predict: what a controller can know, AggreVaTe with
  the belief's cost-to-go); ``"rollout"`` rolls in with the belief oracle's budgets but labels with
  the learner's own cost-to-go (:class:`policies.learn.aggrevate.RolloutExpert`: branch rollouts of
  the current learner on the true acceptances after each action, the cure of mode none's k = 0 trap);
* the *learner* (:class:`RegretMLP`): a torch MLP with tanh hidden layers, one logit per action,
  refitted on the aggregate by the expected regret ``sum_a softmax(logits)_a * regret_a`` plus 0.05
  x cross-entropy towards the expert's best action, exported to the numpy form of
  :mod:`specenv.policy.mlp`.

The mixture plays the expert with probability beta_i, the learner otherwise; the schedule
(:class:`Schedule`) is beta = 1 at iteration 0, then 0.5**i. Every learner returns one result type
(:class:`DaggerResult`) and records one metadata block (:func:`dagger_meta`).

Sources: Ross, Gordon & Bagnell, "A Reduction of Imitation Learning and Structured Prediction to
No-Regret Online Learning" (AISTATS 2011); cost-sensitive labels as in AggreVaTe (Ross & Bagnell 2014).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from specenv.observation.single import ObservationSpec
from specenv.policy.mlp import MLPPolicy
from specenv.traces.traceset import PositionArrays

#: The experts a DAgger learner imitates (:func:`expert_arrays`; ``specenv train --expert``).
EXPERTS = ("oracle", "belief", "rollout")

__all__ = [
    "EXPERTS",
    "DaggerResult",
    "ObservationBelief",
    "EpisodeSource",
    "Expert",
    "RegretMLP",
    "ReplayEpisodes",
    "Schedule",
    "TableExpert",
    "Visits",
    "dagger_meta",
    "expert_arrays",
    "export_net",
    "fit_observation_belief",
    "fit_regret",
    "make_net",
    "run_dagger",
]


@dataclass(frozen=True)
class Schedule:
    """The mixture weight of the expert per iteration: ``first`` at iteration 0, then ``decay**i``."""

    first: float = 1.0
    decay: float = 0.5

    def beta(self, iteration: int) -> float:
        """Probability that the mixture plays the expert at ``iteration``."""
        return self.first if iteration == 0 else self.decay**iteration

    def describe(self) -> str:
        """The schedule as recorded in a policy's metadata (``"1 then 0.5**i"``)."""
        return f"{self.first:g} then {self.decay:g}**i"


@dataclass
class Visits:
    """The states one DAgger iteration's rollouts visited."""

    obs: np.ndarray  # (n, dim) float32 observations
    rows: np.ndarray  # (n,) position rows of the visited states
    cost: float  # total cost of the episodes in ms
    ar: float  # their total AR cost in ms
    k: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # (n,) budgets (see the source)
    #: (n, 8 + kmax) the observation's running statistics at each visited state (``record_state``), else empty
    state: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))


@dataclass
class DaggerResult:
    """Outcome of a DAgger learner: the exported policy, per-iteration statistics, training seconds."""

    policy: MLPPolicy
    history: list[dict[str, float]]
    seconds: float


class Expert(Protocol):
    """What the DAgger loop asks of an expert."""

    def act(self, rows: Any) -> Any:
        """The expert's budget (or action index) at position row(s) ``rows``."""
        ...

    def examples(self, visits: Visits) -> tuple[np.ndarray, np.ndarray]:
        """Training pairs of one iteration's visits: (m, dim) float32 inputs, (m, n_actions) float32 regrets."""
        ...

    def update(self, learner: RegretMLP, visits: list[Visits]) -> bool:
        """After a fit: change the expert from the learner; True if the aggregate must be relabelled."""
        ...


class EpisodeSource(Protocol):
    """What the DAgger loop asks of an environment: play the mixture once per iteration."""

    def rollout(
        self, expert: Expert, learner: RegretMLP, beta: float, rng: np.random.Generator, iteration: int
    ) -> Visits:
        """Roll in: the expert's action with probability ``beta``, else the learner's; the states visited."""
        ...


class TableExpert:
    """An expert that plays a table of actions per position row and labels visits with ``label``.

    Args:
        k: (n_rows,) the expert's action per position row (e.g. the oracle's k*).
        label: ``label(visits) -> (inputs, regrets)``: the training pairs of one iteration.
    """

    def __init__(self, k: np.ndarray, label: Callable[[Visits], tuple[np.ndarray, np.ndarray]]):
        self.k = k
        self.label = label

    def act(self, rows: Any) -> Any:
        """``k[rows]``."""
        return self.k[rows]

    def examples(self, visits: Visits) -> tuple[np.ndarray, np.ndarray]:
        """``label(visits)``."""
        return self.label(visits)

    def update(self, learner: RegretMLP, visits: list[Visits]) -> bool:
        """A fixed expert: nothing to change."""
        return False


def expert_arrays(arrays: PositionArrays, expert: str, seen: int) -> tuple[PositionArrays, dict[str, Any], Any]:
    """The positions table an expert is solved and labels on, what the metadata records of it, its belief.

    Args:
        arrays: The split trained on (its true acceptances).
        expert: ``"oracle"`` (the table itself: the clairvoyant oracle) or ``"belief"`` (every
            ``rho[t, j]`` replaced by what :func:`oracle.belief.fit_draft_belief`, fitted on
            ``arrays``, the train split, believes having seen the confidences of ``seen`` drafts);
            ``"rollout"``: the belief's table too (its budgets roll in; the labels are the learner's
            rollouts, :mod:`policies.learn.aggrevate`).
        seen: Drafts whose confidences the controller sees when it chooses: 0 in mode none, h in
            mode block, kmax for the rounds after the current one of a stop rule.

    Returns:
        ``(table, meta, belief)``: ``meta`` is ``{"expert": expert}`` plus, for the belief, the
        drafts it sees; ``belief`` the fitted :class:`oracle.belief.DraftBelief` (None for the oracle).

    Raises:
        ValueError: For an unknown expert (one line).
    """
    if expert == "oracle":
        return arrays, {"expert": "oracle"}, None
    if expert in ("belief", "rollout"):
        from dataclasses import replace

        from oracle.belief import fit_draft_belief

        belief = fit_draft_belief(arrays)
        rho = belief.predict(arrays, np.arange(len(arrays.L)), seen)
        meta = {"expert": expert, "belief_seen_drafts": int(seen), "belief_bins": int(belief.seen.rate.shape[1])}
        return replace(arrays, rho=rho, greedy=bool(np.all((rho == 0.0) | (rho == 1.0)))), meta, belief
    raise ValueError(f"expert: unknown expert '{expert}' (known: {', '.join(EXPERTS)})")


@dataclass
class ObservationBelief:
    """A controller's belief of the current round's acceptances given its observation (mode none's history).

    One logistic regression (scikit-learn) per draft depth j: P(draft j accepted | drafts 1..j-1
    accepted, the observation), fitted on the states an expert's roll-in visits on the train split.

    Attributes:
        models: The kmax fitted ``sklearn.linear_model.LogisticRegression`` models, depth 1 first.
    """

    models: list[Any]

    def predict(self, obs: np.ndarray) -> np.ndarray:
        """(n, kmax) believed conditional acceptances of (n, dim) observations."""
        return np.stack([m.predict_proba(obs)[:, 1] for m in self.models], axis=1)


def fit_observation_belief(obs: np.ndarray, rho: np.ndarray) -> ObservationBelief:
    """Fit :class:`ObservationBelief` on visited states: observations and their rounds' true acceptances.

    Depth j's regression sees each state twice, labelled accepted with weight ``rho_j S_{j-1}`` and
    rejected with weight ``(1 - rho_j) S_{j-1}`` (``S_{j-1}`` the probability that the round reaches
    depth j; ``rho`` may be 0/1 or a probability): its maximum-likelihood fit is the conditional
    acceptance among the rounds that reach the depth, as :func:`oracle.belief.fit_belief`'s frequencies.

    Args:
        obs: (n, dim) observations of the visited states.
        rho: (n, kmax) the true conditional acceptances of their rounds (train split).

    Raises:
        ValueError: If some depth is never reached or never (or always) accepted in the visits.
    """
    from sklearn.linear_model import LogisticRegression

    from specenv.traces.traceset import survival_table

    reach = np.ones_like(rho)
    reach[:, 1:] = survival_table(rho)[:, :-1]
    X = np.concatenate([obs, obs])
    Y = np.r_[np.ones(len(obs)), np.zeros(len(obs))]
    models = []
    for j in range(rho.shape[1]):
        w = np.r_[rho[:, j] * reach[:, j], (1.0 - rho[:, j]) * reach[:, j]]
        keep = w > 0.0
        if len(np.unique(Y[keep])) < 2:
            raise ValueError(f"observation belief: depth {j + 1} is never reached, or always or never accepted")
        models.append(LogisticRegression(max_iter=500).fit(X[keep], Y[keep], sample_weight=w[keep]))
    return ObservationBelief(models)


def make_net(spec: ObservationSpec, hidden: tuple[int, ...], n_out: int | None = None) -> Any:
    """The torch MLP: observation -> one logit per budget (or ``n_out`` logits), tanh hidden layers."""
    import torch

    layers: list[Any] = []
    sizes = (spec.dim, *hidden)
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(sizes[-1], spec.kmax + 1 if n_out is None else n_out))
    return torch.nn.Sequential(*layers)


def export_net(net: Any, spec: ObservationSpec, name: str, meta: dict[str, Any] | None = None) -> MLPPolicy:
    """The numpy form (:class:`specenv.policy.mlp.MLPPolicy`) of a torch MLP of :func:`make_net`."""
    from policies.learn.export import from_torch_sequential

    return from_torch_sequential(net, spec, name, meta)


def fit_regret(net: Any, opt: Any, xs: Any, rs: Any, epochs: int, batch_size: int = 1024) -> float:
    """Refit ``net`` on the aggregate: expected regret plus 0.05 x cross-entropy towards the best action.

    Args:
        net: The torch MLP.
        opt: Its optimiser.
        xs: (n, dim) observations.
        rs: (n, n_actions) regrets per action (e.g. ``(Q - min Q) / ar_unit``).
        epochs: Passes over the aggregate.
        batch_size: Minibatch size.

    Returns:
        The train regret per state of the near-greedy policy (softmax of 50 x logits), AR units.
    """
    import torch

    target = rs.argmin(dim=1)
    n = len(xs)
    for _ in range(epochs):
        perm = torch.randperm(n)
        for s in range(0, n, batch_size):
            idx = perm[s : s + batch_size]
            logits = net(xs[idx])
            p = torch.softmax(logits, dim=1)
            loss = (p * rs[idx]).sum(dim=1).mean() + 0.05 * torch.nn.functional.cross_entropy(logits, target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        return float((torch.softmax(net(xs) * 50.0, 1) * rs).sum(1).mean())


class RegretMLP:
    """The DAgger learner: a torch MLP (:func:`make_net`) refitted by :func:`fit_regret` with Adam.

    Seeds torch (``torch.manual_seed(seed)``, one thread) before it builds the network, so the
    initial weights and the minibatch order follow from ``seed``.

    Args:
        spec: The observation contract of its inputs.
        hidden: Hidden layer sizes.
        n_out: Number of actions (default ``kmax + 1`` budgets).
        lr: Adam learning rate.
        epochs: Passes over the aggregate per fit.
        batch_size: Minibatch size.
        seed: Torch seed.
    """

    def __init__(
        self,
        spec: ObservationSpec,
        hidden: tuple[int, ...] = (64, 64),
        n_out: int | None = None,
        lr: float = 3e-3,
        epochs: int = 30,
        batch_size: int = 1024,
        seed: int = 0,
    ):
        import torch

        torch.set_num_threads(1)  # small nets: threads only contend on a shared CPU
        torch.manual_seed(seed)
        self.spec = spec
        self.hidden = tuple(hidden)
        self.lr = lr
        self.epochs = epochs
        self.batch_size = batch_size
        self.net = make_net(spec, self.hidden, n_out)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=lr)

    def fit(self, xs: Any, rs: Any) -> float:
        """Refit on the aggregate (tensors); the train regret per state (:func:`fit_regret`)."""
        return fit_regret(self.net, self.opt, xs, rs, self.epochs, self.batch_size)

    def snapshot(self, name: str = "imitation", meta: dict[str, Any] | None = None) -> MLPPolicy:
        """The current network in numpy form."""
        return export_net(self.net, self.spec, name, meta)

    def greedy(self, x: np.ndarray) -> np.ndarray:
        """(n,) argmax action of the torch network on (n, dim) float32 inputs."""
        import torch

        with torch.no_grad():
            return self.net(torch.as_tensor(x)).argmax(dim=1).numpy()

    def hyperparameters(self) -> dict[str, Any]:
        """The learner's part of the metadata's ``hyperparameters``."""
        return {
            "epochs": self.epochs,
            "hidden": list(self.hidden),
            "activation": "tanh",
            "optimizer": "adam",
            "learning_rate": self.lr,
            "batch_size": self.batch_size,
        }


class ReplayEpisodes:
    """Episode source of a round-level replay environment: one episode per generation of its split.

    Each episode is reset with a seed drawn from the loop's generator; each round draws whether the
    expert (its action at the state's position row) or the learner acts.

    Args:
        env: The environment (``specenv/MoESpec-v0``, ``specenv/MoESpecCap-v0``); its
            ``unwrapped.data.generation_ids`` are the episodes.
        arrays: The split's positions in the environment's order (row = ``offsets[g] + t``).
        policy_of: The policy the learner plays in the episodes (default: its numpy snapshot).
        record_k: :attr:`Visits.k` holds the learner's own action in every visited state (the learner
            is then asked also where the expert acts); False: the action played.
        to_action: Maps a chosen index to the environment's action (the joint (k, cap) learner plays
            joint indices); None steps with the index itself.
        record_state: :attr:`Visits.state` holds the observation's running statistics at every visited
            state (``observation_statistics`` of :class:`specenv.envs.replay.MoESpecEnv`), for an
            expert that restarts episodes from the visited states (:mod:`policies.learn.aggrevate`).
    """

    def __init__(
        self,
        env: Any,
        arrays: Any,
        policy_of: Callable[[RegretMLP], Any] | None = None,
        record_k: bool = False,
        to_action: Callable[[int], Any] | None = None,
        record_state: bool = False,
    ):
        self.env = env
        self.arrays = arrays
        self.policy_of = policy_of or (lambda learner: learner.snapshot())
        self.record_k = record_k
        self.to_action = to_action
        self.record_state = record_state

    def rollout(
        self, expert: Expert, learner: RegretMLP, beta: float, rng: np.random.Generator, iteration: int
    ) -> Visits:
        """One episode per generation under the mixture."""
        env, to_action = self.env, self.to_action
        policy = self.policy_of(learner)
        obs_buf, row_buf, k_buf, state_buf, ep_cost, ep_ar = [], [], [], [], 0.0, 0.0
        for g, gid in enumerate(env.unwrapped.data.generation_ids):
            obs, _ = env.reset(seed=int(rng.integers(2**31)), options={"generation_id": int(gid)})
            t, done = 0, False
            lo = int(self.arrays.offsets[g])
            while not done:
                row = lo + t
                obs_buf.append(obs)
                row_buf.append(row)
                if self.record_state:
                    state_buf.append(env.unwrapped.observation_statistics)
                if self.record_k:
                    k_own = int(policy.act(obs))
                    k = int(expert.act(row)) if rng.random() < beta else k_own
                    k_buf.append(k_own)
                else:
                    k = int(expert.act(row)) if rng.random() < beta else policy.act(obs)
                    k_buf.append(k)
                obs, _, done, _, info = env.step(k if to_action is None else to_action(k))
                t = info["t"]
            ep_cost += info["episode_cost_ms"]
            ep_ar += info["ar_cost_ms"]
        return Visits(
            np.asarray(obs_buf, dtype=np.float32),
            np.asarray(row_buf),
            ep_cost,
            ep_ar,
            np.asarray(k_buf, dtype=np.int64),
            np.asarray(state_buf, dtype=np.float64) if self.record_state else np.zeros((0, 0)),
        )


def run_dagger(
    source: EpisodeSource,
    expert: Expert,
    learner: RegretMLP,
    iterations: int,
    rng: np.random.Generator,
    schedule: Schedule = Schedule(),
    log: Callable[[str], None] | None = None,
    label: str = "dagger",
) -> list[dict[str, float]]:
    """The DAgger loop: ``iterations`` rounds of roll-in, aggregation of labelled states and a refit.

    Args:
        source: Plays the mixture and returns the visited states.
        expert: Acts in the mixture and labels the visits.
        learner: Fitted on the aggregate after every iteration.
        iterations: Number of iterations.
        rng: The generator of the episodes' seeds and the mixture's draws.
        schedule: beta per iteration.
        log: Called with one line per iteration.
        label: The learner's name in the log lines.

    Returns:
        One record per iteration: ``iteration``, ``beta``, ``states`` (the aggregate's size),
        ``rollout_speedup`` (AR cost / cost of the iteration's episodes) and ``train_regret_ar_units``.
    """
    import torch

    visits: list[Visits] = []
    X: list[np.ndarray] = []
    R: list[np.ndarray] = []
    history: list[dict[str, float]] = []
    for it in range(iterations):
        beta = schedule.beta(it)
        roll = source.rollout(expert, learner, beta, rng, it)
        visits.append(roll)
        x, r = expert.examples(roll)
        X.append(x)
        R.append(r)
        xs = torch.from_numpy(np.concatenate(X))
        rs = torch.from_numpy(np.concatenate(R))
        regret = learner.fit(xs, rs)
        if expert.update(learner, visits):
            pairs = [expert.examples(v) for v in visits]
            X = [p[0] for p in pairs]
            R = [p[1] for p in pairs]
        stats = {
            "iteration": it,
            "beta": beta,
            "states": len(xs),
            "rollout_speedup": roll.ar / roll.cost,
            "train_regret_ar_units": regret,
        }
        history.append(stats)
        if log:
            log(
                f"{label} it={it} beta={beta:.3f} states={len(xs)} rollout speedup={roll.ar / roll.cost:.3f} "
                f"regret={regret:.4f} AR units"
            )
    return history


def dagger_meta(
    algo: str,
    learner: RegretMLP,
    history: list[dict[str, float]],
    loss: str,
    seed: int,
    schedule: Schedule = Schedule(),
    **head: Any,
) -> dict[str, Any]:
    """The metadata block of a DAgger-trained policy: ``algo``, ``head``, ``hyperparameters``, ``history``.

    Args:
        algo: The learner's name (``"dagger"``, ``"stop-dagger"``, ``"joint-dagger"``, ...).
        learner: The fitted learner (its hyper-parameters).
        history: The loop's per-iteration records.
        loss: The loss in words.
        seed: The seed of the run.
        schedule: The beta schedule.
        head: Learner-specific fields (drafting mode, lookahead, ...), in order, after ``algo``.
    """
    hp = {"iterations": len(history), **learner.hyperparameters()}
    hp |= {"beta_schedule": schedule.describe(), "loss": loss, "seed": seed}
    return {"algo": algo, **head, "hyperparameters": hp, "history": history}
