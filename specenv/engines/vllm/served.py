"""The served policy: the vLLM controller's one call path to a policy of the one protocol.

The controller (:mod:`specenv.engines.vllm.controller`) builds, once per engine step, the stacked
per-request observations of the requests being decided (one row per request, in the drafter's batch
order), their request ids and the step's :class:`specenv.policy.base.BatchStep`, and calls
:meth:`ServedPolicy.act`, which calls ``policy.act(obs, ids, step)`` -- the same method the replay
environments call -- and checks that one budget per row came back. Every kind of policy goes this way:
a per-request heuristic (:class:`specenv.policy.base.Policy` keeps one memory per request id), a peer,
an exported MLP, a batch controller that decides the step jointly (:mod:`policies.batch.controllers`).

:meth:`ServedPolicy.peek` asks what the policy *would* pick (the draft horizon) without changing it: a
``stateless`` policy directly, a per-request :class:`specenv.policy.base.Policy` on a copy of the asked
requests' memories only (:func:`stream_copy`), any other on a private structural copy (:func:`clone`).
:meth:`ServedPolicy.release` forgets finished requests. A ``rowwise`` policy (:func:`rowwise`: a stateless
per-request :class:`specenv.policy.base.Policy` answering each row from that row alone) is asked for its
decisions and its horizons in one call, :meth:`ServedPolicy.act_and_peek`: for it ``act`` and ``peek`` are
the same call and the rows of the one do not change the answers of the other.

What the server knows of the batch features (:class:`specenv.policy.base.BatchStep`), built by the
controller: ``n_active`` = requests decided / B (B the policy's batch size, else ``max_num_seqs``);
``queue`` = waiting / (waiting + running) requests of the scheduler (a server has no episode size R);
``prev_U_batch`` = the previous step's expert union over all its tokens (mean over layers) / n_experts
from the routing tap (0 without it); ``prev_step_cost`` = the previous step's target + draft time / the
measured AR step (the reference of ``prev_cost``) / (kmax+1), clipped like ``prev_cost`` (0 before one).
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from specenv.engines.kernels import kernels
from specenv.observation.single import ObservationSpec
from specenv.policy.base import BatchStep, Policy
from specenv.policy.mlp import MLPPolicy

__all__ = ["ServedPolicy", "base_act", "clone", "compiled_mlp", "per_stream", "rowwise", "stream_copy"]


def rowwise(policy: Any) -> bool:
    """Whether a policy answers each row from that row alone, and keeps nothing: its ``act`` is its ``peek``.

    True for a stateless per-request :class:`specenv.policy.base.Policy` that keeps the base class's ``act``
    (which hands the rows to ``_act_rows`` and reads neither the ids nor the :class:`BatchStep`): the exported
    MLPs, fixed k, the stopping rules. Not for a batch controller (its rows decide jointly), a stateful
    policy (``act`` advances its memory), or any object with an ``act`` of its own (it may read the step).
    """
    return base_act(policy) and bool(policy.stateless)


def base_act(policy: Any) -> bool:
    """Whether a policy is a :class:`specenv.policy.base.Policy` answering through the base class's ``act``.

    That ``act`` hands the rows to ``_act_rows`` (stateless) or to each stream's ``_step``: it never reads
    the :class:`BatchStep`. Not for a class overriding ``act``, nor an ``act`` set on the object itself.
    """
    return isinstance(policy, Policy) and type(policy).act is Policy.act and "act" not in vars(policy)


def compiled_mlp(policy: Any) -> tuple[Any, ...] | None:
    """``(kernel, W0, b0, W1, b1, W2, b2, relu)`` to answer a three-layer MLP policy's rows in one compiled call.

    For an :class:`specenv.policy.mlp.MLPPolicy` (its own ``scores`` and ``_act_rows``) of three layers with
    tanh or ReLU hidden activations, when numba is there (:func:`specenv.engines.kernels.kernels`); None
    otherwise, or with ``SPECENV_NUMBA=0``. The weights are taken as they are now (a later change of the
    policy's weights does not reach the served path; the controller takes them when a policy is installed).
    The budgets equal ``_act_rows``' except where two scores tie to float32 rounding (see
    :func:`specenv.engines.kernels.mlp3`).
    """
    if not (
        isinstance(policy, MLPPolicy)
        and type(policy).scores is MLPPolicy.scores
        and type(policy)._act_rows is MLPPolicy._act_rows
        and len(policy.weights) == 3
        and policy.activation in ("tanh", "relu")
    ):
        return None
    ks = kernels()
    if ks is None:
        return None
    flat = [np.ascontiguousarray(a, dtype=np.float32) for layer in policy.weights for a in layer]
    return (ks.mlp3, *flat, policy.activation == "relu")


def per_stream(policy: Any) -> bool:
    """Whether a policy keeps its memory per request the base class's way, so a peek may copy only the asked requests'.

    True for a stateful :class:`specenv.policy.base.Policy` that keeps the base class's ``act`` and stream
    bookkeeping: each request id's memory is a shallow copy of the policy with fresh memory (what
    ``_reset_state`` binds), everything else shared with the policy object (:func:`stream_copy`).
    """
    return base_act(policy) and not policy.stateless and type(policy)._stream is Policy._stream


class ServedPolicy:
    """A policy installed in the controller, with the observation contract and batch size it is served with.

    Args:
        policy: A policy of the protocol (``act(obs, ids, step)``, ``reset()``, optional ``release``).
        spec: The per-request observation contract the controller builds rows of.
        batch_size: B of ``BatchStep.n_active`` (the policy's batch size, else the server's ``max_num_seqs``).
    """

    def __init__(self, policy: Any, spec: ObservationSpec, batch_size: int):
        self.policy = policy
        self.spec = spec
        self.batch_size = max(int(batch_size), 1)
        self.stateless = bool(getattr(policy, "stateless", False))
        #: False: the policy reads no observation, only how many rows (the protocol's ``observes``).
        self.observes = bool(getattr(policy, "observes", True))
        #: The protocol's optional ``observes_at(n)``: whether a step deciding n requests reads the rows (None:
        #: :attr:`observes` at every n).
        self.observes_at = getattr(policy, "observes_at", None) if self.observes else None
        #: :func:`rowwise`: decisions and horizons may be asked in one call (:meth:`act_and_peek`).
        self.rowwise = rowwise(policy)
        #: :func:`per_stream`: a peek copies the asked requests' memories only (:func:`stream_copy`).
        self.per_stream = per_stream(policy)
        #: False: the policy never reads the :class:`BatchStep` (a :class:`specenv.policy.base.Policy` with the
        #: base class's ``act``, which hands rows to ``_act_rows``/``_step`` only): the controller passes None.
        self.reads_step = not base_act(policy)
        self.name = str(getattr(policy, "name", type(policy).__name__))
        #: a three-layer MLP policy's compiled rows (:func:`specenv.engines.kernels.mlp3`): ``(kernel, W0, b0,
        #: W1, b1, W2, b2, relu)`` of its weights when installed, else None (the policy's own ``_act_rows``)
        self._mlp = compiled_mlp(policy) if self.rowwise else None

    def act(self, obs: np.ndarray, ids: Sequence[Hashable], step: BatchStep | None) -> np.ndarray:
        """The policy's budgets for the rows (n,), one per id (the one call path).

        Raises:
            ValueError: When the policy returns another shape than one budget per row.
        """
        if self.rowwise:
            return self._rows(obs)
        return _checked(self.policy.act(obs, list(ids), step), len(obs))

    def peek(self, obs: np.ndarray, ids: Sequence[Hashable], step: BatchStep | None) -> np.ndarray:
        """What :meth:`act` would answer, leaving the policy as it was (a copy answers unless ``stateless``).

        The copy: of the asked requests' memories for a :func:`per_stream` policy, else of the whole policy.
        """
        if self.rowwise:
            return self._rows(obs)
        ids = list(ids)
        if self.stateless:
            pol = self.policy
        elif self.per_stream and None not in ids:
            pol = stream_copy(self.policy, ids)
        else:
            pol = clone(self.policy)
        return _checked(pol.act(obs, ids, step), len(obs))

    def act_and_peek(self, obs: np.ndarray, ids: Sequence[Hashable], step: BatchStep | None) -> np.ndarray:
        """One call for :meth:`act` on some rows and :meth:`peek` on the others: (n,) budgets, one per row.

        Only for a :attr:`rowwise` policy, for which each row's answer is its row's alone and ``act``
        changes nothing: the answers equal ``act`` on the first rows and ``peek`` on the rest.

        Raises:
            ValueError: For a policy that is not rowwise, or another shape than one budget per row.
        """
        if not self.rowwise:
            raise ValueError(f"policy {self.name!r} is not rowwise: act and peek need calls of their own")
        return self._rows(obs)

    def _rows(self, obs: np.ndarray) -> np.ndarray:
        """A rowwise policy's answers: what its ``act`` (the base class's) returns, without its conversions.

        The base ``act`` of a stateless policy is ``np.asarray(_act_rows(rows), dtype=np.int64)`` of the
        rows as float32; the controller's rows are (n, dim) float32 already.
        """
        if type(obs) is not np.ndarray or obs.dtype != np.float32 or obs.ndim != 2:
            return _checked(self.policy.act(obs, None, None), len(obs))
        mlp = self._mlp
        if mlp is not None:  # one compiled call (the scores to float32 rounding: see kernels.mlp3)
            out = np.empty(len(obs), dtype=np.int64)
            mlp[0](obs, *mlp[1:], out)
            return out
        return _checked(np.asarray(self.policy._act_rows(obs), dtype=np.int64), len(obs))

    def release(self, ids: Sequence[Hashable]) -> None:
        """Forget finished requests (policies without ``release`` keep nothing per request)."""
        release = getattr(self.policy, "release", None)
        if release is not None:
            release(list(ids))


def _checked(out: Any, n: int) -> np.ndarray:
    arr = out if type(out) is np.ndarray else np.asarray(out)
    if arr.shape == (n,):
        return arr
    if arr.shape != (n, 1):
        raise ValueError(f"act returned shape {arr.shape} for {n} observations")
    return arr.reshape(-1)


_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), range, frozenset, slice)


def _copy_value(v: Any, shared: dict[int, Any]) -> Any:
    """A structural copy of one attribute value (see :func:`clone`)."""
    if isinstance(v, _IMMUTABLE) or id(v) in shared:
        return v
    if isinstance(v, np.ndarray):
        return v.copy()
    if type(v) is list:
        return [_copy_value(x, shared) for x in v]
    if type(v) is dict:
        return {k: _copy_value(x, shared) for k, x in v.items()}
    if type(v) is tuple:
        return tuple(_copy_value(x, shared) for x in v)
    return _clone_object(v, shared)


def _clone_object(obj: Any, shared: dict[int, Any]) -> Any:
    cls = type(obj)
    plain = (
        hasattr(obj, "__dict__")
        and not hasattr(cls, "__slots__")
        and getattr(cls, "__deepcopy__", None) is None
        and getattr(cls, "__reduce_ex__", None) is object.__reduce_ex__
        and getattr(cls, "__setstate__", None) in (None, getattr(object, "__setstate__", None))
    )
    if not plain:
        return copy.deepcopy(obj, {k: v for k, v in shared.items()})
    if getattr(cls, "__dataclass_params__", None) is not None and cls.__dataclass_params__.frozen:
        shared[id(obj)] = obj  # a frozen dataclass (e.g. an ObservationSpec): shared, like deepcopy's result
        return obj
    new = object.__new__(cls)
    shared[id(obj)] = new
    new.__dict__.update({k: _copy_value(v, shared) for k, v in obj.__dict__.items()})
    return new


def stream_copy(policy: Policy, ids: Sequence[Hashable]) -> Policy:
    """A copy of a :func:`per_stream` policy on which ``act`` for ``ids`` leaves the original as it was.

    The policy object is copied shallowly with a private stream table holding a copy of each asked request's
    memory: of a stream's attributes, those that are the policy object's own (the same object: its
    configuration, cost model, priors -- what :meth:`Policy._stream` shares) stay shared, the others (what
    ``_reset_state`` bound for that request) are copied as :func:`clone` copies. A request without memory
    yet gets fresh memory in the copy's table, as ``act`` would give it. Not for the id None (the policy
    object's own memory): :meth:`ServedPolicy.peek` clones the whole policy then. Far cheaper than
    :func:`clone` when the policy serves many requests: one request's memory per asked row.

    A policy that changed an attribute shared by every stream *in place* inside ``_act`` would break the
    base class's one-memory-per-request contract in :meth:`Policy.act` already; such a change would
    reach the original here.
    """
    base = policy.__dict__
    shared = {id(v): v for v in base.values()}  # what a stream shares with the policy object stays shared
    new = object.__new__(type(policy))
    new.__dict__.update(base)
    table: dict[Hashable, Policy] = {}
    for i in ids:
        s = policy._streams.get(i)
        if s is None or i in table:
            continue
        c = object.__new__(type(s))
        c.__dict__.update({k: _copy_value(v, shared) for k, v in s.__dict__.items()})
        table[i] = c
    new._streams = table
    return new


def clone(policy: Any) -> Any:
    """A private copy of a policy that shares its cost model(s) and observation decoder (read-only).

    Plain Python objects (attributes in ``__dict__``, no custom copy protocol) are copied structurally:
    numpy arrays copied, lists/dicts/tuples and nested plain objects recursed, immutable values and frozen
    dataclasses shared; anything else goes through ``copy.deepcopy``. The same result as ``deepcopy`` for
    such objects at a fraction of its cost (the horizon copies a stateful policy every step).
    """
    from specenv.cost.batch import BatchCostModel
    from specenv.cost.model import CostModel
    from specenv.observation.single import ObsView

    # shared: the cost models, and a decoder of vectors built from the spec
    read_only = (CostModel, BatchCostModel, ObsView)
    shared = {id(v): v for v in getattr(policy, "__dict__", {}).values() if isinstance(v, read_only)}
    return _clone_object(policy, shared)
