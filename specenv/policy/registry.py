"""The policy registry: a policy named by a folder or by a registered name, never by an import path.

:func:`resolve` turns a string into a policy object (:mod:`specenv.policy.base` protocol):

* a **folder** holding ``policy.json`` + ``weights.npz``: the deployable numpy export, loaded with
  :meth:`specenv.policy.mlp.MLPPolicy.load` (no pickle, no torch);
* a **registered name**, optionally with parameters: ``NAME`` or ``NAME:key=value[,key=value...]``
  (values are read as int, float, ``true``/``false``, or else kept as text). The name's factory is
  called as ``factory(spec, **params)`` with the :class:`specenv.observation.single.ObservationSpec` of the
  caller (the environment's or the server's).

Names come from two places: the entry-point group ``specenv.policies`` of every installed
distribution (``name = "module:Factory"`` in its ``pyproject.toml``; loaded only when that name is
resolved) and :func:`register` calls in this process, which take precedence. specenv's own
distribution declares the heuristics of :mod:`policies.heuristics` that need nothing but an
observation spec:

==========================  ==========================================  ==========================
name                        policy                                      parameters
==========================  ==========================================  ==========================
``fixed-k``                 ``FixedK``: always the same budget          ``k`` (required), e.g.
                                                                        ``fixed-k:k=4``
``transformers-heuristic``  transformers' assisted-generation schedule  ``start`` (20)
``confidence-threshold``    stop drafting below a draft confidence      ``threshold`` (0.4),
                            (needs ``lookahead`` > 0)                   ``adaptive`` (false)
``cascade``                 Cascade's test/set-phase utility control    ``test_rounds``,
                                                                        ``set_rounds``
``ucb``                     UCB1 bandit over the budget (BanditSpec)    ``c`` (0.5)
``adaedl``                  AdaEDL's entropy-bound stop                 ``lam``, ``gamma`` (0.2)
``svip``                    SVIP's entropy stop                         ``h``
``specdec-pp``              SpecDec++'s acceptance head and stop        ``threshold``, ``w_q``,
                                                                        ``w_ent``, ``w_margin``,
                                                                        ``w_depth``, ``bias``
``disco``                   DISCO's continue/stop classifier            as ``specdec-pp``
``vllm-adaptive-``          vLLM's adaptive verification (batch 1)      ``stale`` (true)
``verification``
``vllm-dsd-table``          vLLM's batch-size table of k                ``k``, ``schedule``
                                                                        (``1-4:5;5-64:3``)
==========================  ==========================================  ==========================

The peers (:mod:`policies.peers`) fit what is not given on the train split of ``dataset`` (a
registered set or a folder; default ``paper-default``) with ``cost_model`` (default ``fit-train``).

A factory declares its parameters in an attribute ``parameters`` (``{name: Param(...)}``, see
:class:`Param` and :func:`declare`): :func:`check` and :func:`resolve` refuse a value of the wrong type
(``k=4.5``, ``k=true``, ``k=``), out of range (a count below 1, a probability outside [0, 1]) or not
finite before the factory runs, with one line ``policy 'NAME:...': parameter 'k': ...``, so every
caller (the Python API, ``serve``, ``export``, ``bench``, the vLLM controller) refuses the same
things with the same line. A key given twice is refused by :func:`parse`.

Policies that need more than a spec (a fitted cost model, an oracle's lambda: ``goodput``,
``delta-space``) are built in Python, not by name. A string is never imported: a dotted path or
``module:attribute`` is just an unknown name.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from specenv.observation.single import ObservationSpec

#: The entry-point group that installed distributions use to register policies by name.
ENTRY_POINT_GROUP = "specenv.policies"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_REGISTERED: dict[str, Callable[..., Any]] = {}

Factory = Callable[..., Any]


@dataclass(frozen=True)
class Param:
    """The declaration of one policy parameter: its type and its range (bounds included unless open).

    Attributes:
        kind: ``int`` (an integer, never a bool or a float), ``float`` (a finite number, never a bool),
            ``bool``, ``str`` (non-empty text) or ``tuple`` (a non-empty list of integers, each in range).
        lo: Smallest value allowed (None: unbounded).
        hi: Largest value allowed (None: unbounded).
        open_lo: ``lo`` itself excluded (e.g. a scale ``> 0``).
        what: What the value is, for the message (``"a probability"``).
    """

    kind: type
    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    what: str = ""

    def check(self, key: str, value: Any) -> Any:
        """``value`` as the declared type, or ValueError ``parameter 'KEY': PROBLEM``."""

        def bad(problem: str) -> ValueError:
            return ValueError(f"parameter {key!r}: {problem} (got {value!r})")

        if self.kind is bool:
            if not isinstance(value, bool):
                raise bad("must be true or false")
            return value
        if self.kind is str:
            if not isinstance(value, str) or not value:
                raise bad("must be a non-empty name")
            return value
        if self.kind is tuple:  # a non-empty list of integers, each in range (the API's keyword)
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
                raise bad("must be a non-empty list of integers (a keyword of the API: NAME:key=value gives one value)")
            return tuple(Param(int, self.lo, self.hi, what=self.what).check(key, v) for v in value)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise bad("must be an integer" if self.kind is int else "must be a number")
        if self.kind is int:
            if not isinstance(value, numbers.Integral):
                raise bad("must be an integer")
            value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise bad("must be finite")
        too_low = self.lo is not None and (value <= self.lo if self.open_lo else value < self.lo)
        if too_low or (self.hi is not None and value > self.hi):
            lo = "" if self.lo is None else f"{'>' if self.open_lo else '>='} {self.lo:g}"
            hi = "" if self.hi is None else f"<= {self.hi:g}"
            raise bad(f"must be {' and '.join(x for x in (lo, hi) if x)}{f' ({self.what})' if self.what else ''}")
        return value


#: Shorthands of the common declarations.
COUNT = Param(int, 1, what="a count")
BUDGET = Param(int, 0, what="a draft budget")
PROBABILITY = Param(float, 0.0, 1.0, what="a probability")
NONNEGATIVE = Param(float, 0.0)
REAL = Param(float)
FLAG = Param(bool)
TEXT = Param(str)
BUDGETS = Param(tuple, 0, what="draft budgets")


def declare(*exclusive: tuple[str, ...], **params: Param) -> Callable[[Factory], Factory]:
    """Decorator: declare a factory's parameters (its attribute ``parameters``), checked by :func:`resolve`.

    Each positional tuple names parameters of which at most one may be given (attribute ``exclusive``):
    where one would override another, giving both is refused rather than one silently ignored.
    """

    def mark(factory: Factory) -> Factory:
        factory.parameters = dict(params)  # type: ignore[attr-defined]
        factory.exclusive = tuple(exclusive)  # type: ignore[attr-defined]
        return factory

    return mark


def check_params(factory: Factory, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with every declared one checked and converted (see :class:`Param`); others as given.

    Raises:
        ValueError: ``parameter 'KEY': PROBLEM`` for the first bad declared parameter.
    """
    declared: Mapping[str, Param] = getattr(factory, "parameters", None) or {}
    accepted = _keywords(factory)
    for key in params:
        if key not in declared and accepted is not None and key not in accepted:
            known = ", ".join(sorted(set(declared) | accepted)) or "none"
            raise ValueError(f"parameter {key!r}: unknown (known: {known})")
    for group in getattr(factory, "exclusive", ()):
        given = [k for k in group if k in params]
        if len(given) > 1:
            raise ValueError(f"parameters {' and '.join(map(repr, given))}: give one of them, not both")
    return {k: (declared[k].check(k, v) if k in declared else v) for k, v in params.items()}


def _keywords(factory: Factory) -> set[str] | None:
    """The keyword parameters ``factory(spec, **params)`` accepts after ``spec`` (None: any, or unknown)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    ps = list(sig.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in ps):
        return None
    positional = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {p.name for p in ps[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} if positional else None


def register(name: str, factory: Factory, *, replace: bool = False) -> str:
    """Register a policy factory under a name in this process.

    Args:
        name: Letters, digits and ``_ . + -`` (no ``:`` or ``/``, which the string form reserves).
        factory: Called as ``factory(spec, **params)``; returns a policy object (with ``act``).
        replace: Allow replacing a name already registered in this process.

    Returns:
        The name (what to pass to :func:`resolve`, ``specenv serve --policy`` or the vLLM settings).

    Raises:
        ValueError: For a malformed name, a factory that is not callable, or a name already
            registered with another factory (without ``replace``).
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"policy name {name!r}: use letters, digits and '_.+-' only")
    if not callable(factory):
        raise ValueError(f"policy {name!r}: factory {factory!r} is not callable")
    old = _REGISTERED.get(name)
    if old is not None and old is not factory and not replace:
        raise ValueError(f"policy {name!r} is already registered (pass replace=True to replace it)")
    _REGISTERED[name] = factory
    return name


def unregister(name: str) -> None:
    """Forget a name registered with :func:`register` (entry points stay)."""
    _REGISTERED.pop(name, None)


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
    """Every name :func:`resolve` knows: entry points and :func:`register` calls, sorted."""
    return sorted(set(_entry_points()) | set(_REGISTERED))


def _factory(name: str) -> Factory:
    if name in _REGISTERED:
        return _REGISTERED[name]
    ep = _entry_points().get(name)
    if ep is None:
        known = ", ".join(names()) or "none"
        raise ValueError(
            f"policy {name!r}: not a policy folder (policy.json + weights.npz) nor a registered name "
            f"(registered: {known})"
        )
    try:
        return ep.load()
    except Exception as exc:  # a broken installation: say which entry point
        raise ValueError(
            f"policy {name!r}: entry point {ep.value!r} does not load ({type(exc).__name__}: {exc})"
        ) from None


#: Numbers of the string form: ASCII digits only (Python's int() and float() also take ``1_0``, spaces and
#: other scripts' digits, which a policy string would then read as a number nobody wrote).
_INT = re.compile(r"[+-]?[0-9]+\Z")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z|[+-]?(?:inf|infinity|nan)\Z", re.I)


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    return text


def parse(name: str) -> tuple[str, dict[str, Any]]:
    """Split ``NAME:key=value,...`` into the name and its parameters.

    Raises:
        ValueError: For a malformed parameter list.
    """
    base, sep, rest = name.partition(":")
    params: dict[str, Any] = {}
    if sep:
        for item in rest.split(","):
            key, eq, val = item.partition("=")
            key = key.strip()
            if not eq or not key.isidentifier():
                raise ValueError(f"policy {name!r}: parameters must read key=value[,key=value...]")
            if key in params:
                raise ValueError(f"policy {name!r}: parameter {key!r} given twice")
            params[key] = _value(val.strip())
    return base, params


def is_folder(name_or_folder: str | os.PathLike[str]) -> bool:
    """Whether the string names a policy folder (one holding ``policy.json``, of any file type).

    A ``policy.json`` that is a FIFO, a device or a dangling link still makes the folder a policy
    folder: loading it then says what is wrong with the file (never "not a policy folder").
    """
    return os.path.lexists(Path(name_or_folder) / "policy.json")


def check(name_or_folder: str | os.PathLike[str]) -> None:
    """Check that a policy string names something, without building it (no spec needed).

    A folder is loaded; a name must be registered and its parameters well formed.

    Raises:
        ValueError: One line naming the policy and the problem.
    """
    if is_folder(name_or_folder):
        resolve(name_or_folder)
        return
    name = os.fspath(name_or_folder)
    factory = _factory(name.partition(":")[0])
    _, parsed = parse(name)
    try:
        check_params(factory, parsed)
    except ValueError as exc:
        raise ValueError(f"policy {name!r}: {exc}") from None


def resolve(name_or_folder: str | os.PathLike[str], spec: ObservationSpec | None = None, **params: Any) -> Any:
    """The policy named by a folder or a registered name (see the module docstring).

    Args:
        name_or_folder: A policy folder, or ``NAME`` / ``NAME:key=value,...``.
        spec: The caller's observation layout: required for a name (the factory builds the policy
            for it); for a folder, when given, the policy's own spec must equal it.
        **params: More parameters for a name's factory (override those of the string).

    Returns:
        A policy object of the one protocol (``reset``, ``act``).

    Raises:
        ValueError: One line naming the policy and the problem (unknown name, missing spec, a
            folder whose observation layout differs from ``spec``, a factory that rejects its
            parameters).
    """
    if is_folder(name_or_folder):
        from specenv.policy.mlp import MLPPolicy

        if params:
            raise ValueError(f"policy {os.fspath(name_or_folder)!r}: a policy folder takes no parameters")
        policy = MLPPolicy.load(name_or_folder, expect=spec)  # one line naming a differing field
        return policy
    if not isinstance(name_or_folder, str):
        raise ValueError(f"policy {os.fspath(name_or_folder)!r}: not a policy folder (no policy.json)")
    factory = _factory(name_or_folder.partition(":")[0])  # an unknown name is the first thing to say
    _, parsed = parse(name_or_folder)
    if spec is None:
        raise ValueError(f"policy {name_or_folder!r}: a registered name needs the observation spec to build it")
    try:
        policy = factory(spec, **check_params(factory, {**parsed, **params}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"policy {name_or_folder!r}: {exc}") from None
    if not hasattr(policy, "act"):
        raise ValueError(f"policy {name_or_folder!r}: the factory returned {type(policy).__name__}, not a policy")
    return policy
