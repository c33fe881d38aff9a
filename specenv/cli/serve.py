"""``specenv serve``: vLLM's OpenAI-compatible server with the speculation-length controller (and recorder).

Every option, the policy (loaded once), the models and the cost model are checked before vLLM is
imported.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from specenv.cli.common import (
    VLLM_HINT,
    check_out_folder,
    err,
    fail,
    os_message,
    out,
)


def serve(
    ctx: typer.Context,
    policy: Annotated[
        str,
        typer.Option(
            help="Policy: exported folder (policy.json + weights.npz), a registered name with optional "
            "parameters (e.g. ucb, fixed-k:k=4; entry-point group specenv.policies), or 'none' (no control: "
            "record only)."
        ),
    ],
    models: Annotated[
        str | None,
        typer.Option(
            help="Model set to serve: a shipped name (small-moe-v1; see `specenv models`) or a model-set folder. "
            "Gives vLLM --model (target and tokenizer) and --speculative-config (draft_model) unless they "
            "are given after --."
        ),
    ] = None,
    kmax: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="num_speculative_tokens with --models (default: the policy folder's kmax, else 8).",
        ),
    ] = None,
    record: Annotated[Path | None, typer.Option(help="Record the rounds table (atomic Parquet parts) here.")] = None,
    fallback_k: Annotated[
        int | None, typer.Option(min=0, max=64, help="k when the policy fails (default: num_speculative_tokens).")
    ] = None,
    draft_horizon: Annotated[
        str,
        typer.Option(
            help="max (drafter proposes num_speculative_tokens), policy (as many as the policy may use, asked "
            "before the round's outcome) or outcome (asked once the target verified: CPU runner, lazy drafter)."
        ),
    ] = "max",
    cost_model: Annotated[Path | None, typer.Option(help="Cost-model JSON for the prev_cost observation.")] = None,
    part_rounds: Annotated[int, typer.Option(min=1, max=10**7, help="Rounds per recorded part file.")] = 2048,
    print_command: Annotated[
        bool,
        typer.Option(
            "--print-command",
            help="Print the command (with the environment variables) that starts the same server on this "
            "install, and exit.",
        ),
    ] = False,
) -> None:
    """Start vLLM's OpenAI-compatible server with the speculation-length controller (and recorder).

    `--models small-moe-v1` serves a shipped model set; everything after `--` is passed to vLLM
    (--port, --dtype, ...; or your own model and --speculative-config without --models), so specenv's
    own options go before `--`. On CPU it sets
    VLLM_CPU_KVCACHE_SPACE (GiB of KV cache: 20% of the available memory, at most 4) and
    VLLM_CPU_OMP_THREADS_BIND=nobind unless they are set. Needs the vllm extra; see the README. The
    policy, the models, the cost model and the record folder are checked before vLLM is imported.
    """
    import shlex

    from specenv.engines.vllm import settings as vs

    user_args = _vllm_args(list(ctx.args), models is not None)
    settings, folder = _serve_settings(policy, record, fallback_k, draft_horizon, cost_model, part_rounds)
    args = [*user_args, *_serve_model_args(models, kmax, settings.policy, folder, user_args, settings)]
    args += vs.shutdown_args(args)  # SIGTERM/SIGINT: drain, close the recording, exit 0 (engines.vllm.drain)
    args += vs.serve_args(settings)
    dist = vs.vllm_distribution()
    env = vs.serve_env(os.environ, args, on_cpu=vs.vllm_on_cpu(dist))
    argv = vs.launch_command(args, dist)
    if print_command:
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())
        out.print(prefix + shlex.join(argv), markup=False, highlight=False)
        if dist is None:
            err.print(
                "specenv: note: vLLM is not installed here; this is the form for a standard vLLM install "
                "(with vllm-cpu, specenv serve runs python -m " + vs.LAUNCHER_MODULE + ")",
                markup=False,
                highlight=False,
            )
        return
    _run_vllm(argv, env, dist)


def _vllm_args(args: list[str], have_models: bool) -> list[str]:
    """The arguments given after ``--`` for vLLM; fail on none (without ``--models``) or on ones specenv sets."""
    if args[:1] == ["--"]:
        args = args[1:]
    if not args and not have_models:
        fail(
            "no vLLM arguments: give --models small-moe-v1 (see specenv models), or your model after --, e.g. "
            'specenv serve --policy P -- MODEL --speculative-config \'{"method": "draft_model", ...}\''
        )
    for flag in ("--scheduler-cls", "--async-scheduling", "--additional-config", "--load-format", "--worker-cls"):
        if any(a == flag or a.startswith(flag + "=") for a in args):
            fail(f"{flag}: set by specenv serve, do not pass it to vLLM")
    return args


def _serve_model_args(
    models: str | None, kmax: int | None, policy: str | None, folder: Any, user_args: list[str], settings: Any
) -> list[str]:
    """``--model``/``--speculative-config`` of ``--models``, and the policy checked against the served model.

    ``folder`` is the policy of a policy folder, loaded by :func:`_serve_settings` (None for a name).

    Both are checked here, before vLLM starts: the model set, and the policy's contract against what the
    model folders and the speculative config say (:func:`specenv.engines.vllm.settings.policy_refusal`:
    drafting mode, kmax = num_speculative_tokens, experts, top-k, draft signals).
    """
    from specenv.engines.vllm import settings as vs

    own_spec = vs.has_flag(user_args, "--speculative-config", "-sc")
    if models is None:
        if kmax is not None:
            fail("--kmax: only with --models (without it, set num_speculative_tokens in --speculative-config)")
        _check_served_policy(policy, folder, _user_spec_tokens(user_args), None, None)
        _check_served_facts(None, _user_spec_tokens(user_args), settings)
        return []
    if kmax is not None and own_spec:
        fail("--kmax: the --speculative-config given after -- sets num_speculative_tokens; give one of them")
    from specenv.engines.vllm.models import check_model_set, vllm_model_dirs

    try:
        n_experts, top_k = _target_routing(check_model_set(models))  # nothing written before every check passed
    except (ValueError, OSError) as exc:
        fail(f"--models: {os_message(exc) if isinstance(exc, OSError) else exc}")
    spec = getattr(folder, "spec", None)
    k = kmax if kmax is not None else (spec.kmax if spec is not None else vs.DEFAULT_SPEC_TOKENS)
    _check_served_policy(policy, folder, _user_spec_tokens(user_args) if own_spec else k, n_experts, top_k)
    _check_served_facts(check_model_set(models), _user_spec_tokens(user_args) if own_spec else k, settings)
    try:
        dirs = vllm_model_dirs(models)
    except (ValueError, OSError) as exc:
        fail(f"--models: {os_message(exc) if isinstance(exc, OSError) else exc}")
    return vs.model_args(str(dirs.target), str(dirs.draft), k, user_args, dirs.name)


def _target_routing(target: Path) -> tuple[int | None, int | None]:
    """Routed experts per MoE layer and experts per token of a target folder's ``config.json`` (None: dense)."""
    from specenv.validation import read_json

    cfg = read_json(target / "config.json", what="model config")
    if not isinstance(cfg, dict):
        return None, None
    n, k = cfg.get("num_experts", cfg.get("num_local_experts")), cfg.get("num_experts_per_tok")
    return (n if isinstance(n, int) else None), (k if isinstance(k, int) else None)


def _user_spec_tokens(user_args: list[str]) -> int | None:
    """``num_speculative_tokens`` of a ``--speculative-config`` JSON among the vLLM arguments (None if absent)."""
    for i, a in enumerate(user_args):
        for flag in ("--speculative-config", "-sc"):
            if a == flag and i + 1 < len(user_args):
                text = user_args[i + 1]
            elif a.startswith(flag + "="):
                text = a[len(flag) + 1 :]
            else:
                continue
            try:
                n = json.loads(text).get("num_speculative_tokens")
            except (ValueError, AttributeError):
                return None
            return n if isinstance(n, int) and not isinstance(n, bool) else None
    return None


def _check_served_policy(
    policy: str | None, folder: Any, n_spec: int | None, n_experts: int | None, top_k: int | None
) -> None:
    """Exit 2 with one ``--policy`` line when the served model cannot serve the policy (before vLLM starts).

    A folder's policy is checked as trained (kmax must equal ``num_speculative_tokens``); a registered
    name is built for the served model's observation spec, as the controller will build it.
    ``folder`` is the folder's policy, already loaded (None for a name).
    """
    from specenv.engines.vllm import settings as vs
    from specenv.observation.single import ObservationSpec
    from specenv.policy import registry

    if policy is None:
        return
    pol = folder
    if pol is None:
        if n_spec is None:
            return
        try:
            pol = registry.resolve(policy, ObservationSpec(kmax=max(n_spec, 1), n_experts=n_experts or 128))
        except ValueError as exc:
            fail(f"--policy: {exc}")
    why = vs.policy_refusal(pol, num_spec_tokens=n_spec, n_experts=n_experts, top_k=top_k, exact_kmax=True)
    if why is not None:
        fail(f"--policy: {why}")


def _check_served_facts(target: Path | None, n_spec: int | None, settings: Any) -> None:
    """Exit 2 with one line when the cost model or ``--fallback-k`` does not fit the served models."""
    from specenv.engines.vllm.facts import served_facts, served_refusal

    served = served_facts(target) if target is not None else None
    why = served_refusal(served, num_spec_tokens=n_spec, cost_model=settings.cost_model, fallback_k=settings.fallback_k)
    if why is not None:
        fail(why)


def _serve_settings(
    policy: str,
    record: Path | None,
    fallback_k: int | None,
    draft_horizon: str,
    cost_model: Path | None,
    part_rounds: int,
) -> tuple[Any, Any]:
    """Check ``serve``'s policy, cost model (both loaded) and record folder; build its settings.

    Returns:
        The settings, and the policy of a policy folder (loaded here, once; None for a registered
        name or no policy): the checks against the served model use it.
    """
    from specenv.cost.model import CostModel
    from specenv.engines.vllm.settings import DRAFT_HORIZONS, SpecenvSettings
    from specenv.io import not_regular
    from specenv.policy import registry

    if draft_horizon not in DRAFT_HORIZONS:
        fail(f"--draft-horizon: unknown value {draft_horizon!r} (known: {', '.join(DRAFT_HORIZONS)})")
    pol = folder = None
    if policy.lower() != "none":
        path = Path(policy)
        pol = str(path.resolve()) if path.exists() else policy
        try:
            if registry.is_folder(pol):
                folder = registry.resolve(pol)  # loaded once, here
            else:
                registry.check(pol)  # a name is registered (built later for the server's spec)
        except ValueError as exc:
            fail(f"--policy: {exc}")
    if cost_model is not None:
        why = not_regular(cost_model)
        if why is not None:
            fail(f"--cost-model: {cost_model} {why}")
        try:
            CostModel.load(cost_model)
        except ValueError as exc:
            fail(f"--cost-model: {exc}")
    if record is not None:
        check_out_folder("--record", record)
    try:
        settings = SpecenvSettings(
            policy=pol,
            record=None if record is None else str(record.resolve()),
            fallback_k=fallback_k,
            draft_horizon=draft_horizon,
            part_rounds=part_rounds,
            cost_model=None if cost_model is None else str(cost_model.resolve()),
        )
    except ValueError as exc:
        fail(str(exc))
    return settings, folder


def _run_vllm(argv: list[str], env: dict[str, str], dist: tuple[str, str] | None) -> None:
    """Run vLLM's OpenAI-compatible server in this process: ``argv`` from ``launch_command``, ``env`` set first."""
    import importlib.util

    from specenv.engines.vllm.settings import LAUNCHER_MODULE

    if dist is None or importlib.util.find_spec("vllm") is None:
        fail(f"vLLM is not installed: {VLLM_HINT}")
    for k, v in env.items():
        os.environ[k] = v
        err.print(f"specenv: {k}={v} (set by specenv serve; set it yourself to choose)", markup=False, highlight=False)
    if argv[:2] == ["vllm", "serve"]:
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = argv
    else:  # vllm-cpu: the launcher module (argv = [python, -m, LAUNCHER_MODULE, args...])
        from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

        assert argv[1:3] == ["-m", LAUNCHER_MODULE]
        sys.argv = ["vllm-api-server", *argv[3:]]
    vllm_main()
