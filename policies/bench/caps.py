"""The joint (k, expert cap) benchmark: speed and quality side by side, and the joint oracle's frontier.

On a trace set with the ``caps-v1`` extension (held-out split, cost model fitted on the train split by
default, the capped rounds included), every row reports the pooled speedup (sum AR / sum cost) with
a 95% percentile-bootstrap interval over the held-out generations, the token mismatch rate
(mismatched committed tokens / tokens) and the mean log-prob gap per token (each capped round's mean
gap weighted by its committed tokens; uncapped rounds count 0). Rows:

* the k-only oracle (:func:`oracle.dp.solve`) and the joint oracle at every quality weight of the
  sweep (:func:`oracle.caps.frontier`): the speed / quality frontier;
* MoE-Spec's fixed budget with fixed k: every (k >= 1, cap level >= 1), exactly
  (:func:`oracle.caps.evaluate_joint`);
* every k-policy of the k-only benchmark (:func:`policies.bench.single.default_entries`: the fixed
  budgets, the heuristics, the peers and the learned policies found for the set) at every cap level
  0..C (:class:`policies.caps.controllers.FixedCap`): fixed budgets exactly, the others by rollouts in
  ``specenv/MoESpecCap-v0`` (each charged by its drafting mode, as in the k-only benchmark);
* joint learned controllers: trained here by imitation of the joint oracle at the given weights
  (:func:`policies.caps.controllers.train_joint_dagger`, on the train split) or loaded from folders; rollouts.
  With training, the k-only imitation learner of the same recipe (:func:`policies.learn.imitation.train_dagger`,
  same cost model, lookahead, iterations, epochs and seed) is trained too and runs as a k-policy.

Rollouts: ``episodes`` per held-out generation with the seeds of :func:`specenv.envs.rollout.episode_seeds`;
on a greedy set every episode is the same (the capped rounds are deterministic too), so one suffices.

The headline comparison (``comparison``): the best joint learned controller whose mismatch rate is
at most ``max_mismatch`` (1% by default) against the best k-only controller (cap level 0, every
non-oracle row), and the joint oracle's best point under the same quality constraint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from oracle.caps import DEFAULT_WEIGHTS, JointEvaluation, evaluate_joint, solve_joint
from policies import shipped_policy_dir
from policies.bench.context import Context, build_context
from policies.bench.result import BenchResult
from policies.bench.runner import Progress, run_family
from policies.bench.single import Entry, _learned, default_entries, skip_reason
from policies.bench.stats import summarise_pooled
from policies.caps.controllers import FixedCap, JointMLP, train_joint_dagger

__all__ = ["DEFAULT_WEIGHTS", "K_ORACLE", "CapRow", "CapsFamily", "cap_bench_family", "run_cap_bench"]

K_ORACLE = "k-only oracle (SSP)"


@dataclass
class CapRow:
    """A row of the caps roster: its name and table columns, and what evaluates it.

    ``kind``: ``"k-oracle"`` (exact), ``"joint oracle"`` (exact, at ``weight``), ``"fixed"`` (a fixed
    ``(k, cap)``, exact), ``"entry"`` (a k-policy ``entry`` at cap level ``cap_level``: exact for a
    fixed budget, else rollouts), ``"train"`` (a joint learner trained at ``weight``, rollouts) or
    ``"load"`` (a joint policy from ``folder``, rollouts).
    """

    kind: str
    name: str
    family: str
    cap: str
    k: int = 0
    cap_level: int = 0
    weight: float = 0.0
    entry: Entry | None = None
    folder: Path | None = None


#: A row's outcome: its per-generation frame, capped share and (exact oracle rows) the evaluation; None: skipped.
CapOutcome = tuple[pd.DataFrame, float, JointEvaluation | None] | None


def _per_gen(name: str, family: str, ev_cost, ar, mis, lp, lengths, gids) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "policy": name,
            "family": family,
            "generation_id": np.asarray(gids, dtype=np.int64),
            "cost_ms": np.asarray(ev_cost, dtype=np.float64),
            "ar_ms": np.asarray(ar, dtype=np.float64),
            "mismatches": np.asarray(mis, dtype=np.float64),
            "lpgap": np.asarray(lp, dtype=np.float64),
            "tokens": np.asarray(lengths, dtype=np.int64),
        }
    )


def _exact(name: str, family: str, ev: JointEvaluation) -> pd.DataFrame:
    return _per_gen(name, family, ev.cost, ev.ar, ev.mismatches, ev.lpgap, ev.lengths, ev.generation_ids)


def _env_kwargs(entry: Entry | None, policy: Any) -> dict[str, Any]:
    """The drafting mode, lookahead and signals of a row: the entry's, or a joint policy's contract."""
    if entry is not None:
        return {"lookahead": entry.lookahead, "drafting": entry.mode, "signals": entry.signals}
    h = policy.spec.lookahead
    return {"lookahead": h, "drafting": "block" if h else "none", "signals": policy.spec.signals if h else ("q",)}


@dataclass
class CapsFamily:
    """The caps family: every k-policy at every cap level, MoE-Spec's grid, the joint learners; the oracles' frontier.

    The environment factory is :meth:`make_env` (``specenv/MoESpecCap-v0`` on the test split, in the
    row's drafting mode); exact rows use the joint tables of the run (:func:`~specenv.replay.caps.joint_tables`).
    """

    ctx: Context
    tab: Any
    weights: Sequence[float]
    train_weights: Sequence[float]
    joint_policies: Sequence[Path]
    episodes: int
    seed: int
    n_boot: int
    max_mismatch: float
    train_kwargs: dict[str, Any] | None
    only: Sequence[str] | None
    closing: str | None = None
    trained: dict[str, Any] = field(default_factory=dict)

    def cap_name(self, c: int) -> str:
        """The name of cap level ``c`` (``"none"`` for 0)."""
        return "none" if c == 0 else str(self.tab.levels[c - 1])

    def roster(self) -> list[CapRow]:
        """The oracles, the fixed grid, every k-policy at every cap level, the joint learners (module docstring)."""
        ctx, C = self.ctx, self.tab.n_levels
        entries = default_entries(ctx)
        if self.only:
            entries = [e for e in entries if any(o in e.name for o in self.only)]
            if not entries:  # as the k-only benchmark: a filter that keeps nothing is a typo, not a request
                raise ValueError(f"--only: {list(self.only)} matches no k-policy{skip_reason(ctx, self.only)}")
        if self.train_weights:  # the k-only learner of the same recipe, for an apples-to-apples learned row
            entries.append(self._k_only_learner())
        rows = [CapRow("k-oracle", K_ORACLE, "oracle", "none")]
        rows += [
            CapRow("joint oracle", f"joint oracle (w={w:g})", "joint oracle", "joint", weight=w) for w in self.weights
        ]
        for c in range(1, C + 1):
            for k in range(1, ctx.kmax + 1):
                name = f"MoE-Spec fixed cap B={self.cap_name(c)}, k={k}"
                rows.append(CapRow("fixed", name, "fixed cap, fixed k", self.cap_name(c), k=k, cap_level=c))
        for entry in entries:
            for c in range(C + 1 if entry.exact_k != 0 else 1):  # k = 0 is never capped: no capped copies
                name = entry.name if c == 0 else f"{entry.name} @ cap B={self.cap_name(c)}"
                family = "k-only" if c == 0 else "fixed cap + k-policy"
                rows.append(CapRow("entry", name, family, self.cap_name(c), cap_level=c, entry=entry))
        rows += [CapRow("train", "", "joint learned", "joint", weight=w) for w in self.train_weights]
        rows += [CapRow("load", "", "joint learned", "joint", folder=f) for f in self.joint_policies]
        return rows

    def _k_only_learner(self) -> Entry:
        """The k-only imitation learner of the joint recipe (:func:`policies.learn.imitation.train_dagger`)."""
        from policies.learn.imitation import train_dagger

        kw = dict(self.train_kwargs or {})
        h = int(kw.get("lookahead", 0))
        kpol = train_dagger(
            self.ctx.source,
            self.ctx.kmax,
            self.ctx.cost_model_arg,
            lookahead=h,
            iterations=int(kw.get("iterations", 4)),
            epochs=int(kw.get("epochs", 30)),
            seed=self.seed,
        ).policy
        return Entry(
            "k-only imitation (trained here)",
            _learned(kpol),
            lookahead=h,
            learned=True,
            drafting="block" if h else "none",
        )

    def row_name(self, row: CapRow) -> str:
        """The row's name (a joint learner's is known once trained or loaded)."""
        return row.name or ("joint learner" if row.kind == "train" else f"joint policy {row.folder}")

    def remote(self, rows: list[CapRow]) -> None:
        """Every caps row runs here."""
        return None

    def make_env(self, entry: Entry | None, policy: Any) -> Any:
        """``specenv/MoESpecCap-v0`` on the test split in the drafting mode of the row (:func:`_env_kwargs`)."""
        import gymnasium as gym

        from specenv.envs.caps import CAP_ID

        ctx = self.ctx
        kw = _env_kwargs(entry, policy)
        return gym.make(CAP_ID, dataset=ctx.source, kmax=ctx.kmax, split="test", cost_model=ctx.cost_model_arg, **kw)

    def evaluate(self, row: CapRow) -> CapOutcome:
        """The row's per-generation frame and capped share: exactly, or by rollouts in :meth:`make_env`'s env."""
        from oracle.dp import solve

        ctx, test, cm, tab = self.ctx, self.ctx.test, self.ctx.cost_model, self.tab
        if row.kind == "k-oracle":
            ko = solve(test, cm)
            zero = np.zeros(len(ko.cost))
            return _per_gen(row.name, row.family, ko.cost, ko.ar, zero, zero, ko.lengths, ko.generation_ids), 0.0, None
        if row.kind == "joint oracle":
            ev = solve_joint(test, cm, row.weight, tables=tab)
            return _exact(row.name, row.family, ev), ev.capped_share, ev
        if row.kind == "fixed":
            ev = evaluate_joint(test, cm, (row.k, row.cap_level), tables=tab)
            return _exact(row.name, row.family, ev), ev.capped_share, None
        if row.kind == "entry":
            entry = row.entry
            assert entry is not None
            if entry.exact_k is not None:
                etab = tab if entry.lookahead == 0 and entry.mode == "none" else None
                ev = evaluate_joint(
                    test, cm, (int(entry.exact_k), row.cap_level), row.name, entry.lookahead, entry.mode, tables=etab
                )
                return _exact(row.name, row.family, ev), ev.capped_share, None
            try:
                from specenv.replay.tables import replay_data

                data = replay_data(
                    ctx.source, ctx.kmax, "test", ctx.cost_model_arg, entry.lookahead, entry.mode, entry.signals
                )
                pol = FixedCap(entry.make(data.spec), row.cap_level)
            except ValueError as exc:
                ctx.notes.append(f"skipped '{row.name}': {exc}")
                return None
            df, share = self._rollouts(entry, pol, row.name, row.family)
            return df, share, None
        if row.kind == "train":
            r = train_joint_dagger(
                ctx.source, row.weight, ctx.kmax, ctx.cost_model_arg, seed=self.seed, **(self.train_kwargs or {})
            )
            row.name = f"{r.policy.name} (joint learned)"
            self.trained[row.name] = r.policy
            ctx.notes.append(f"'{row.name}' trained on the train split in {r.seconds:.1f} s")
            df, share = self._rollouts(None, JointMLP(r.policy), row.name, row.family)
            return df, share, None
        assert row.kind == "load" and row.folder is not None
        try:
            stored = JointMLP.load(row.folder).spec
            h = stored.lookahead
            sig = stored.signals if h else ("q",)
            expect = dataclasses.replace(ctx.spec, lookahead=h, signals=sig, cap_levels=tab.n_levels)
            pol = JointMLP.load(row.folder, expect=expect)
        except ValueError as exc:
            raise ValueError(f"--joint-policy: {exc}") from None
        row.name = f"{pol.name} (joint, loaded)"
        df, share = self._rollouts(None, pol, row.name, row.family)
        return df, share, None

    def _rollouts(self, entry: Entry | None, policy: Any, name: str, family: str) -> tuple[pd.DataFrame, float]:
        """Roll ``policy`` out in the joint env (test split): per-generation means over the episodes, capped share."""
        from specenv.envs.rollout import episode_seeds, rollout

        episodes = self.episodes
        env = self.make_env(entry, policy)
        gids = np.asarray(env.unwrapped.data.generation_ids, dtype=np.int64)
        ep_gid = np.repeat(gids, episodes)
        ep_r = np.tile(np.arange(episodes, dtype=np.int64), len(gids))
        seeds = episode_seeds(self.seed, ep_gid, ep_r)
        try:
            res = rollout(env, policy, list(zip(ep_gid.tolist(), seeds.tolist(), strict=True)))
        finally:
            env.close()

        def mean(x: np.ndarray) -> np.ndarray:
            return np.asarray(x, dtype=np.float64).reshape(len(gids), episodes).mean(axis=1)

        lengths = np.asarray(env.unwrapped.data.lengths)
        share = float(res.quality["capped_rounds"].sum() / res.rounds.sum())
        q = res.quality
        df = _per_gen(
            name, family, mean(res.cost), mean(res.ar), mean(q["mismatches"]), mean(q["lpgap"]), lengths, gids
        )
        return df, share

    def result(self, rows: list[CapRow], outcomes: list[CapOutcome]) -> BenchResult:
        """The rows' pooled speedups and quality, the frontier, the headline comparison."""
        parts: list[pd.DataFrame] = []
        meta: dict[str, dict[str, Any]] = {}
        fr_rows = []
        for row, got in zip(rows, outcomes, strict=True):
            if got is None:  # skipped (the note says why)
                continue
            df, share, ev = got
            parts.append(df)
            evaluation = "rollout" if row.kind in ("train", "load") else "exact"
            if row.kind == "entry":
                assert row.entry is not None
                evaluation = "exact" if row.entry.exact_k is not None else "rollout"
            meta[row.name] = {"family": row.family, "cap": row.cap, "evaluation": evaluation, "capped_share": share}
            if ev is not None:
                fr_rows.append(
                    {
                        "quality_weight": row.weight,
                        "speedup": ev.speedup_pooled,
                        "mismatch_rate": ev.mismatch_rate,
                        "lpgap": ev.lpgap_mean,
                        "capped_share": ev.capped_share,
                    }
                )
        gen = pd.concat(parts, ignore_index=True)
        summary = summarise_pooled(gen, meta, self.n_boot, self.seed)
        test = self.ctx.test
        context = {
            "dataset": self.ctx.dataset,
            "split": "test",
            "test_generations": int(test.n_generations),
            "test_tokens": int(test.lengths.sum()),
            "kmax": int(self.ctx.kmax),
            "caps": list(self.tab.levels),
            "cost_model": self.ctx.cost_model_arg,
            "episodes": self.episodes,
            "seed": self.seed,
            "n_boot": self.n_boot,
            "unit_ms": self.tab.unit_ms,
        }
        return BenchResult(
            "caps",
            summary,
            context,
            list(self.ctx.notes),
            generations=gen,
            frontier=pd.DataFrame(fr_rows),
            comparison=_compare(summary, self.max_mismatch),
            joint_policies=self.trained,
        )


def run_cap_bench(dataset: Any, progress: Progress | None = None, **options: Any) -> BenchResult:
    """Every joint baseline, the joint learners and the frontier on the held-out split of a caps set.

    ``options`` are :func:`cap_bench_family`'s (kmax, cost model, weights, learners, episodes, ...);
    ``progress`` is called with (done, total, row name) as each row starts.

    Returns:
        The :class:`~policies.bench.result.BenchResult` of family ``"caps"``.

    Raises:
        ValueError: One line naming the argument (a set without caps columns names ``dataset``).
    """
    return run_family(cap_bench_family(dataset, **options), progress)


def cap_bench_family(
    dataset: Any,
    kmax: int | None = None,
    cost_model: str = "fit-train",
    policy_dir: Path | None = None,
    weights: Sequence[float] = DEFAULT_WEIGHTS,
    train_weights: Sequence[float] = (),
    joint_policies: Sequence[Path] = (),
    episodes: int = 1,
    seed: int = 0,
    n_boot: int = 2000,
    max_mismatch: float = 0.01,
    train_kwargs: dict[str, Any] | None = None,
    only: Sequence[str] | None = None,
) -> CapsFamily:
    """The :class:`CapsFamily` :func:`run_cap_bench` runs, its roster checked.

    Everything that can refuse the run before a row is evaluated (the set, the cost model, ``only``)
    is checked here: the CLI builds the family before it starts its progress lines, so a refusal is
    its one line.

    Args:
        dataset: Registry name or folder of a set with the ``caps-v1`` extension, or the loaded
            :class:`~specenv.traces.traceset.TraceSet`.
        kmax: Largest budget (default the set's).
        cost_model: ``"fit-train"`` (default), ``"fit"``, ``"profile"`` or a cost-model JSON.
        policy_dir: Folder of trained k-policies (default: those shipped for the set, if any).
        weights: Quality weights of the joint oracle's frontier (AR steps per mismatched token).
        train_weights: Weights at which to train a joint learned controller here (train split).
        joint_policies: Folders of trained joint policies to evaluate.
        episodes: Rollout episodes per held-out generation.
        seed: Seed of the episodes and the bootstrap.
        n_boot: Bootstrap resamples.
        max_mismatch: The quality constraint of the headline comparison (mismatched-token rate).
        train_kwargs: Extra arguments of :func:`policies.caps.controllers.train_joint_dagger`.
        only: Keep only the k-policies whose name contains one of these (the oracles and the fixed
            cap x fixed k grid always run); a filter that keeps no k-policy is refused.

    Raises:
        ValueError: One line naming the argument (a set without caps columns names ``dataset``).
    """
    from specenv.replay.caps import joint_tables

    pdir = policy_dir if policy_dir is not None else shipped_policy_dir(dataset)
    ctx = build_context(dataset, kmax, cost_model, pdir)
    try:
        tab = joint_tables(ctx.test, ctx.cost_model)
    except ValueError as exc:
        raise ValueError(f"dataset={ctx.dataset!r}: {exc}") from None
    family = CapsFamily(
        ctx, tab, weights, train_weights, joint_policies, episodes, seed, n_boot, max_mismatch, train_kwargs, only
    )
    family.roster()  # a ValueError for an --only that keeps no k-policy
    return family


def _best(rows: pd.DataFrame) -> dict[str, Any] | None:
    if rows.empty:
        return None
    r = rows.loc[rows["speedup"].idxmax()]
    return {k: r[k] for k in ("policy", "speedup", "speedup_lo", "speedup_hi", "mismatch_rate", "lpgap")}


def _compare(s: pd.DataFrame, max_mismatch: float) -> dict[str, Any]:
    ok = s["mismatch_rate"] <= max_mismatch + 1e-12
    k_only = _best(s[(s["family"] == "k-only")])
    joint = _best(s[(s["family"] == "joint learned") & ok])
    capped = _best(s[s["family"].isin(["fixed cap, fixed k", "fixed cap + k-policy"]) & ok])
    oracle = _best(s[(s["family"] == "joint oracle") & ok])
    out: dict[str, Any] = {
        "max_mismatch_rate": max_mismatch,
        "best_k_only_controller": k_only,
        "best_joint_learned_within_constraint": joint,
        "best_fixed_cap_controller_within_constraint": capped,
        "joint_oracle_within_constraint": oracle,
        "k_only_oracle": _best(s[s["policy"] == K_ORACLE]),
    }
    if k_only and joint:
        out["joint_learned_gain_over_best_k_only"] = joint["speedup"] / k_only["speedup"] - 1
        out["goal_10pct_met"] = bool(out["joint_learned_gain_over_best_k_only"] >= 0.10)
    if k_only and oracle:
        out["joint_oracle_gain_over_best_k_only"] = oracle["speedup"] / k_only["speedup"] - 1
    return out
