"""The controller's recording: the rounds table of a vLLM server, with its provenance.

:class:`Recording` is the part of :class:`specenv.engines.vllm.controller.SpecControlScheduler` that
writes what the server ran (one row per request and round, :mod:`specenv.engines.recorder` for the
columns) into a recording folder: start, flush and stop, the engine's provenance and the row of a round.
It reads the controller's settings, tap, step counter and policy; while recording, the controller hands
each step's rounds (values only) to :meth:`_defer_rows`, and the recorder's writer thread builds their
rows (:func:`step_rows`) when it writes the part.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from specenv.engines.vllm.bookkeeping import OUTCOME_FIELDS, StepClock
from specenv.engines.vllm.settings import SpecenvSettings

__all__ = ["Recording", "step_rows"]


class Recording:
    """The recording methods of the controller (a base class of it; module docstring)."""

    settings: SpecenvSettings
    recorder: Any
    tap: Any
    policy: Any
    spec: Any
    vllm_config: Any
    num_spec_tokens: int
    _step: int

    def summary(self) -> dict[str, Any]:
        """The controller's counters (its own method)."""
        raise NotImplementedError

    def _chain_signals(self) -> None:
        """SIGTERM/SIGINT also flush the recording (the controller's own method)."""
        raise NotImplementedError

    def start_recording(self, folder: str, **settings: Any) -> None:
        """Start writing the rounds table to ``folder`` (closing a recording in progress).

        Args:
            folder: Recording folder.
            **settings: Overrides of recording fields of the settings (``part_rounds``,
                ``part_seconds``, ``category``, ``run``, ``name``).

        Raises:
            ValueError: If the routing tap is not bound in this process.
        """
        from specenv.engines.recorder import PartRecorder
        from specenv.traces.schema import ModelFacts

        if self.tap is None:
            raise ValueError(
                "recording needs the routing tap: start vLLM with load_format='specenv' "
                "(--load-format specenv); on an accelerator also with the single-process executor "
                "(--distributed-executor-backend uni)"
            )
        self.stop_recording()
        if settings:
            self.settings = SpecenvSettings(**{**self.settings.to_json(), **settings, "record": str(folder)})
        else:
            self.settings.record = str(folder)
        s = self.settings
        facts = ModelFacts(self.tap.n_layers, self.tap.n_experts, self.tap.top_k)
        self.recorder = PartRecorder(
            folder,
            facts,
            kmax=max(int(self.num_spec_tokens), self.spec.kmax, 1),
            meta=self._provenance(),
            source="vllm",
            name=s.name,
            max_new_tokens=int(s.max_new_tokens or self.spec.max_new_tokens),
            part_rounds=s.part_rounds,
            part_seconds=s.part_seconds,
            with_tokens=s.record_tokens,
        )
        self._chain_signals()

    def stop_recording(self, closed_by: str = "stop_recording") -> None:
        """Write the last part and close the recording (no-op when not recording).

        Args:
            closed_by: What closed it, kept in the run summary (``stop_recording``, ``shutdown``, or
                ``signal``: the engine had no request left after SIGTERM/SIGINT).
        """
        if self.recorder is not None:
            rec, self.recorder = self.recorder, None
            rec.close(summary={**self.summary(), "closed_by": closed_by})

    def flush_recording(self) -> None:
        """Hand the buffered rounds to the writer now (they appear as a part shortly after).

        Not needed to keep rounds: the recorder writes buffered rounds within ``part_seconds`` on its own.
        """
        if self.recorder is not None:
            self.recorder.flush()

    def _provenance(self) -> dict[str, Any]:
        import vllm

        vc = self.vllm_config
        sc = vc.speculative_config
        return {
            "engine": f"vllm {vllm.__version__} {sc.method if sc else 'no-spec'}",
            "vllm_version": vllm.__version__,
            "model": str(vc.model_config.model),
            "dtype": str(vc.model_config.dtype),
            "speculative": None
            if sc is None
            else {
                "method": sc.method,
                "model": str(getattr(sc, "model", None)),
                "num_speculative_tokens": sc.num_speculative_tokens,
            },
            "enforce_eager": bool(vc.model_config.enforce_eager),
            "max_num_seqs": int(vc.scheduler_config.max_num_seqs),
            "device": str(vc.device_config.device),
            "settings": self.settings.to_json(),
            "policy": None if self.policy is None else str(getattr(self.policy, "name", type(self.policy).__name__)),
        }

    def _defer_rows(self, rounds: list[tuple[Any, ...]], clock: StepClock, batch_size: int, batch_tokens: int) -> None:
        """Hand one step's rounds to the recorder; their rows are built on its writer thread (:func:`step_rows`).

        ``rounds``: per round ``(generation_id, round, request_id, outcome, drafted, policy_k, fallback,
        capped, greedy, verified_tokens)``, ``outcome`` the values of
        :data:`specenv.engines.vllm.bookkeeping.OUTCOME_FIELDS` (``Req.out``); values only, never live state.
        """
        s = self.settings
        step = (self._step, batch_size, batch_tokens, clock.timing, s.category, s.run, s.record_tokens)
        self.recorder.add_deferred(len(rounds), partial(step_rows, step, rounds))


def step_rows(step: tuple[Any, ...], rounds: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """The rows of one step's rounds (see :mod:`specenv.engines.recorder` for the columns)."""
    number, batch_size, batch_tokens, timing, category, run, with_tokens = step
    rows = []
    for gid, rnd, req_id, out, drafted, policy_k, fallback, capped, greedy, verified in rounds:
        o = dict(zip(OUTCOME_FIELDS, out, strict=False))
        row = {
            "generation_id": gid,
            "category": category,
            "round": rnd,
            **{c: o[c] for c in ("K", "m", "accepted", "L", "U_r", "E_max", "T_T_ms", "T_D_ms")},
            "request_id": req_id,
            "t": o["t"],
            "step": number,
            "batch_size": batch_size,
            "batch_tokens": batch_tokens,
            "drafted": drafted,
            "policy_k": policy_k,
            "fallback": fallback,
            "capped": capped,
            "greedy": greedy,
            "step_ms": o["step_ms"],
            "T_T_cpu_ms": o["T_T_cpu_ms"],
            "T_D_cpu_ms": o["T_D_cpu_ms"],
            "timing": timing,
            "run": run,
            "accepted_raw": o["accepted_raw"],
        }
        if with_tokens:
            row["verified_tokens"] = verified
        rows.append(row)
    return rows
