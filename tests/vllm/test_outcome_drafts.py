"""``draft_horizon="outcome"``: the step's drafts set inside the engine step, once the target has verified.

With ``draft_horizon="policy"`` the controller fixes a step's drafts at ``schedule``, before the round it
verifies has an outcome: the policy's k if every draft were accepted. A policy that wants more drafts after
a rejection (here: 1 after a full acceptance, 4 after a rejection) is then capped at the 1 it asked for.
With ``"outcome"`` the CPU runner (:class:`specenv.engines.vllm.lazydraft.PlainIdleSteps`) asks the
controller (:meth:`SpecControlScheduler.outcome_drafts`) after sampling, before the drafter runs: the
accepted drafts are known, and this policy reads nothing else, so at batch 1 every round drafts exactly
the k the policy then decides (no cap, nothing drafted in vain). The same holds for a policy of the
round's U_r and cost (a hash of the two: any approximation changes its answer): the controller reads the
round's routing from the tap and prices the round before the drafter runs. Outputs equal plain greedy
decoding on both settings (the target's verification is untouched).
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from vhelpers import KMAX, MAX_TOKENS, PROMPTS, controller_of, greedy  # noqa: E402

from specenv.engines.vllm import load_recording  # noqa: E402
from specenv.observation.single import ObservationSpec  # noqa: E402
from specenv.policy.base import Policy  # noqa: E402


class AfterFull(Policy):
    """k = ``full`` after a fully accepted round (and in the first), ``short`` after a rejection."""

    name = "after-full"
    stateless = True

    def __init__(self, spec: ObservationSpec, full: int, short: int):
        super().__init__(spec)
        self.full, self.short = full, short

    def _act(self, obs) -> int:
        v = self.view
        whole = v.first_round(obs) or v.prev_accepted(obs) == v.prev_k(obs)
        return self.full if whole else self.short


class HashOfTheRound(Policy):
    """k from a hash of the last round's U_r and cost (1..KMAX; the first round: 2)."""

    name = "hash-of-the-round"
    stateless = True

    def _act(self, obs) -> int:
        v = self.view
        if v.first_round(obs):
            return 2
        return 1 + int(1000.0 * (v.prev_U(obs) + v.prev_cost(obs))) % KMAX


POLICIES = {"after-full": lambda spec: AfterFull(spec, full=1, short=4), "hash": HashOfTheRound}


def served(llm, prompts: list[str], horizon: str, rec, policy: str = "after-full"):
    ctl = controller_of(llm)
    spec = ObservationSpec(kmax=KMAX, lookahead=0, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts)
    ctl.set_policy(POLICIES[policy](spec))
    ctl.settings.draft_horizon = horizon
    shutil.rmtree(rec, ignore_errors=True)
    before = dict(ctl.stats)
    try:
        ctl.start_recording(str(rec))
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
        ctl.stop_recording()
    finally:
        ctl.set_policy(None)
        ctl.settings.draft_horizon = "max"
    rounds = load_recording(rec).rounds
    delta = {k: ctl.stats[k] - before[k] for k in ("capped", "decisions", "fallbacks", "outcome_calls")}
    return [list(o.outputs[0].token_ids) for o in outs], rounds, delta


@pytest.mark.parametrize("batch, policy", [(1, "after-full"), (4, "after-full"), (1, "hash"), (4, "hash")])
def test_drafts_set_after_the_outcome_are_lossless_and_never_capped(engine, plain_reference, tmp_path, batch, policy):
    prompts = PROMPTS[:batch] if batch > 1 else PROMPTS[:2]
    runs = {}
    for horizon in ("policy", "outcome"):
        if batch == 1:  # one request at a time
            got = [served(engine, [p], horizon, tmp_path / f"{horizon}-{i}", policy) for i, p in enumerate(prompts)]
            tokens = [t for g in got for t in g[0]]
            rounds = [g[1] for g in got]
            stats = {k: sum(g[2][k] for g in got) for k in got[0][2]}
        else:
            tokens, r, stats = served(engine, prompts, horizon, tmp_path / horizon, policy)
            rounds = [r]
        for p, toks in zip(prompts, tokens, strict=True):
            assert toks == plain_reference[p]["token_ids"], (horizon, p)
        assert stats["decisions"] > 0 and stats["fallbacks"] == 0
        runs[horizon] = (rounds, stats)
    # "policy": after a rejection the policy wants 4, but the horizon asked before the outcome was 1; the
    # hash of the round's U_r and cost differs from the hash of the ones the horizon assumed
    assert runs["policy"][1]["capped"] > 0 and runs["policy"][1]["outcome_calls"] == 0
    # "outcome": asked once the accepted drafts, U_r and cost are known, the drafts always cover the policy's k
    rounds, stats = runs["outcome"]
    assert stats["capped"] == 0 and stats["outcome_calls"] > 0
    for df in rounds:
        assert (df["K"] <= df["policy_k"]).all()
        assert (df["drafted"] >= df["policy_k"]).all()
        if batch == 1:  # one request a step: the drafts are exactly the k it then verifies
            assert (df["drafted"] == df["policy_k"]).all()
    if policy == "after-full":  # it did ask for more after a rejection, and got it
        assert any((df["policy_k"] == 4).any() for df in rounds)
    else:  # it asked for many budgets, each of them drafted
        assert len(set().union(*(set(df["policy_k"].tolist()) for df in rounds))) >= 4
