"""The facts of the models a vLLM server serves, and the one check of what a run brings against them.

``specenv serve`` and ``specenv abtest`` bring a cost model, a trace set and a fallback budget to a
served model set; each records facts about the model it was made for. :func:`served_facts` reads
the served side (the target's ``config.json`` and the model set's ``manifest.json``) and
:func:`served_refusal` compares, before any engine starts:

* a cost model's ``top_k``, ``n_experts`` and ``n_layers`` (where recorded) with the target's
  routing, and its ``kmax`` with ``num_speculative_tokens`` (it must price every budget served);
* a trace set's model facts (``n_layers``, ``n_experts``, ``top_k``) with the target's, its recorded
  model set (``extra.models``) with the served set's identity where both are recorded, and that it
  records prompts at all (``extra.prompt_set``: an A/B serves the set's own prompts);
* ``--fallback-k`` at most ``num_speculative_tokens`` (the drafter proposes no more).

A policy is checked against the same served model by :func:`specenv.engines.vllm.settings.policy_refusal`
(the controller runs that one at start too); this module does not repeat it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ServedFacts", "served_facts", "served_refusal"]


@dataclass(frozen=True)
class ServedFacts:
    """What the served target says about itself (None: not stated, nothing is compared).

    Attributes:
        n_layers: MoE layers of the target (its decoder layers that route to experts).
        n_experts: Routed experts per MoE layer.
        top_k: Experts per token.
        model_set: The model set's identity, ``NAME-vVERSION`` from its ``manifest.json``.
        config: The target's ``config.json`` (named in the messages).
    """

    n_layers: int | None
    n_experts: int | None
    top_k: int | None
    model_set: str | None
    config: Path


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def served_facts(target: str | os.PathLike[str]) -> ServedFacts:
    """The facts of a target folder (``config.json``; the set's ``manifest.json`` one folder up, if any).

    Raises:
        ValueError: One line naming the file when ``config.json`` is not a JSON object.
    """
    from specenv.validation import read_json

    target = Path(target)
    path = target / "config.json"
    cfg = read_json(path, what="model config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    n_experts = _int(cfg.get("num_experts", cfg.get("num_local_experts")))
    top_k = _int(cfg.get("num_experts_per_tok"))
    n_layers = None
    layers, step = _int(cfg.get("num_hidden_layers")), _int(cfg.get("decoder_sparse_step", 1))
    dense = cfg.get("mlp_only_layers") or []
    if n_experts is not None and layers is not None and step is not None and isinstance(dense, list):
        n_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    model_set = None
    manifest = target.parent / "manifest.json"
    if manifest.is_file():
        from specenv.engines.hf.manifest import read_model_manifest

        m = read_model_manifest(target.parent)
        model_set = f"{m['name']}-v{m['version']}" if "name" in m and "version" in m else None
    return ServedFacts(n_layers, n_experts, top_k, model_set, path)


def _recorded_model_set(extra: Any) -> str | None:
    """A trace set's recorded model set (``extra.models``: ``{"name", "version"}`` or ``"NAME-vN"``)."""
    models = extra.get("models") if isinstance(extra, dict) else None
    if isinstance(models, str):
        return models
    if isinstance(models, dict) and isinstance(models.get("name"), str) and _int(models.get("version")):
        return f"{models['name']}-v{models['version']}"
    return None


def served_refusal(
    served: ServedFacts | None,
    *,
    num_spec_tokens: int | None = None,
    cost_model: str | os.PathLike[str] | None = None,
    traces: Any = None,
    traces_opt: str = "--traces",
    fallback_k: int | None = None,
) -> str | None:
    """Why a run cannot bring these to the served model, as one line naming the option; None when it can.

    Args:
        served: The served target's facts (:func:`served_facts`; None: a model given to vLLM directly,
            whose facts are unknown here: only ``num_spec_tokens`` is compared).
        num_spec_tokens: The server's ``num_speculative_tokens`` (None: unknown, not compared).
        cost_model: A cost-model JSON file (``--cost-model``).
        traces: A loaded trace set (``--traces``) whose prompts are served.
        traces_opt: The option that gave ``traces``.
        fallback_k: ``--fallback-k``.
    """
    where = f"the served target ({served.config})" if served is not None else ""
    if fallback_k is not None and num_spec_tokens is not None and fallback_k > num_spec_tokens:
        return (
            f"--fallback-k: {fallback_k} exceeds the server's num_speculative_tokens={num_spec_tokens} "
            "(the drafter proposes no more)"
        )
    if cost_model is not None:
        from specenv.cost.model import CostModel

        try:
            model = CostModel.load(cost_model)
        except OSError as exc:
            return f"--cost-model: {exc.filename or cost_model}: {exc.strerror or exc}"
        except ValueError as exc:
            return f"--cost-model: {exc}"
        for name in ("top_k", "n_experts", "n_layers"):
            mine, theirs = getattr(model, name), getattr(served, name, None)
            if mine is not None and theirs is not None and mine != theirs:
                return f"--cost-model: {cost_model}: field '{name}' = {mine}, {where} has {name} = {theirs}"
        if num_spec_tokens is not None and model.kmax < num_spec_tokens:
            return (
                f"--cost-model: {cost_model}: field 'kmax' = {model.kmax} prices K <= {model.kmax}, the server "
                f"runs num_speculative_tokens={num_spec_tokens}"
            )
    if traces is not None:
        name = traces.manifest.name
        facts = traces.facts
        for field in ("top_k", "n_experts", "n_layers"):
            mine, theirs = getattr(facts, field), getattr(served, field, None)
            if theirs is not None and mine != theirs:
                return f"{traces_opt}: trace set '{name}' records model.{field} = {mine}, {where} has {theirs}"
        extra = traces.manifest.extra
        recorded = _recorded_model_set(extra)
        served_set = getattr(served, "model_set", None)
        if recorded is not None and served_set is not None and recorded != served_set:
            return (
                f"{traces_opt}: trace set '{name}' was recorded on model set {recorded}, the served models are "
                f"{served_set}"
            )
        if not (isinstance(extra, dict) and isinstance(extra.get("prompt_set"), str)):
            return (
                f"{traces_opt}: trace set '{name}' records no prompts (extra.prompt_set): its generations cannot "
                "be served again (give a set collected from prompts, e.g. by specenv collect)"
            )
    return None
