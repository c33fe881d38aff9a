"""The controller's recording: the rounds table of a vLLM server, with its provenance.

:class:`Recording` is the part of :class:`specenv.engines.vllm.controller.SpecControlScheduler` that
writes what the server ran (one row per request and round, :mod:`specenv.engines.recorder` for the
columns) into a recording folder: start, flush and stop, the engine's provenance and the row of a round.
It reads the controller's settings, tap, step counter and policy; the controller calls :meth:`_row`
for every round of a step while recording.
"""

from __future__ import annotations

from typing import Any

from specenv.engines.vllm.bookkeeping import Round, StepClock
from specenv.engines.vllm.settings import SpecenvSettings

__all__ = ["Recording"]


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

    def _row(self, rnd: Round, out: dict[str, Any], clock: StepClock, batch: dict[str, int]) -> dict[str, Any]:
        """The round's row of the recording (see :mod:`specenv.engines.recorder` for the columns)."""
        st, request = rnd.st, rnd.request
        sp = request.sampling_params
        row = {
            "generation_id": st.gid,
            "category": self.settings.category,
            "round": st.rounds,
            **{c: out[c] for c in ("K", "m", "accepted", "L", "U_r", "E_max", "T_T_ms", "T_D_ms")},
            "request_id": rnd.req_id,
            "t": out["t"],
            "step": self._step,
            **batch,
            "drafted": st.drafted,
            "policy_k": st.policy_k,
            "fallback": st.fallback,
            "capped": st.capped,
            "greedy": bool(sp is None or sp.temperature == 0.0),
            "step_ms": clock.step_ms,
            "T_T_cpu_ms": clock.t_cpu,
            "T_D_cpu_ms": out["T_D_cpu_ms"],
            "timing": clock.timing,
            "run": self.settings.run,
            "accepted_raw": out["accepted_raw"],
        }
        if self.settings.record_tokens:
            row["verified_tokens"] = [int(request.all_token_ids[-1]), *map(int, rnd.drafts)]
        return row
