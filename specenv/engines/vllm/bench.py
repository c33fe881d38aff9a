"""Measuring vLLM engines: engine options, timed greedy passes, persistent engine processes.

The machinery shared by ``specenv abtest`` (:mod:`specenv.abtest`) and ``scripts/vllm_bench.py``:

* :func:`engine_options` -- the ``LLM(...)`` options of one engine configuration (a plain JSON dict:
  ``models``, ``k`` = ``num_speculative_tokens`` (0: no speculation), ``max_num_seqs``,
  ``dynamic_sd`` = vLLM's ``num_speculative_tokens_per_batch_size`` table, ``controller`` (install
  specenv's scheduler and routing tap, default true) and ``settings`` (:class:`SpecenvSettings`));
* :func:`timed_pass` -- one greedy pass of a prompt list at a given concurrency (``batch``: the
  prompts run in groups of that many concurrent requests), with the wall time, the tokens, the outputs
  and, on a controller engine, the controller's own time per engine step (:func:`step_overhead`);
* :class:`EngineProcess` -- one engine kept alive in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
  the engine core and its scheduler live in that process), driven by JSON commands, so that several
  engines can be measured in turn, interleaved, without paying their start-up (~40 s each on CPU) more
  than once. The worker side is :func:`worker_main`; the caller supplies how a policy is built from a
  JSON description (this layer does not import the policies).

Importing this module does not import vLLM; the functions that run an engine do.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from specenv.engines.vllm.hugepages import advise_engine, backing, with_hugepages

#: Environment of an engine process on CPU (each set only when the caller has not set it).
ENGINE_ENV = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # pinned threads crawl on a shared machine
    "OMP_NUM_THREADS": "1",
}
#: File descriptor (in the worker) on which :func:`worker_main` answers.
FD_VAR = "SPECENV_BENCH_FD"

#: Builds a policy object from its JSON description, for a controller (``make_policy(desc, ctl)``).
PolicyFactory = Callable[[dict[str, Any], Any], Any]


def engine_options(cfg: dict[str, Any]) -> dict[str, Any]:
    """``LLM(**options)`` of an engine configuration (see the module docstring)."""
    from specenv.engines.vllm.models import vllm_model_dirs
    from specenv.engines.vllm.settings import SpecenvSettings, engine_kwargs

    dirs = vllm_model_dirs(cfg["models"])
    kw: dict[str, Any] = dict(
        model=str(dirs.target),
        tokenizer=str(dirs.target),
        dtype="float32",
        enforce_eager=True,
        max_model_len=min(dirs.max_model_len, int(cfg.get("max_model_len", dirs.max_model_len))),
        seed=0,
        max_num_seqs=int(cfg.get("max_num_seqs", 1)),
        enable_prefix_caching=False,  # every arm prefills every prompt: the same work, run after run
        # a small explicit KV cache (the CPU default, 1 GiB and more, makes a dozen engines not fit in memory)
        kv_cache_memory_bytes=int(cfg.get("kv_cache_mb", 256)) << 20,
    )
    if int(cfg.get("k", 0)) > 0:
        sc: dict[str, Any] = {
            "method": "draft_model",
            "model": str(dirs.draft),
            "num_speculative_tokens": int(cfg["k"]),
        }
        if cfg.get("dynamic_sd"):
            sc["num_speculative_tokens_per_batch_size"] = [tuple(int(x) for x in e) for e in cfg["dynamic_sd"]]
        kw["speculative_config"] = sc
    if cfg.get("controller", True):
        kw.update(engine_kwargs(SpecenvSettings(**cfg.get("settings", {})), tap=bool(cfg.get("tap", True))))
    else:
        kw["async_scheduling"] = False  # what the controller runs with: the comparison is the scheduler
    return kw


def build_llm(cfg: dict[str, Any]) -> Any:
    """A ``vllm.LLM`` for an engine configuration (in this process)."""
    from vllm import LLM

    from specenv.engines.vllm.tap import register

    register()
    return LLM(**engine_options(cfg))


def scheduler_of(llm: Any) -> Any:
    """The scheduler of an in-process engine (a SpecControlScheduler on a controller engine)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def encode_prompts(models: str, prompt_ids: list[int], prompt_set: str = "stdlib-code-v1") -> list[list[int]]:
    """Token ids of prompts of a prompt set (by id), with the model set's tokenizer."""
    from tokenizers import Tokenizer

    from specenv.engines.hf.models import load_prompts
    from specenv.engines.vllm.models import vllm_model_dirs

    tok = Tokenizer.from_file(str(vllm_model_dirs(models).target / "tokenizer.json"))
    by_id = {p.id: p for p in load_prompts(prompt_set)}
    missing = [i for i in prompt_ids if i not in by_id]
    if missing:
        raise ValueError(f"prompt set {prompt_set!r} has no prompt {missing[0]}")
    return [tok.encode(by_id[i].text).ids for i in prompt_ids]


def step_overhead(ctl: Any, since: int) -> dict[str, Any]:
    """The controller's time per engine step since step ``since`` (:meth:`SpecControlScheduler.step_log`).

    Returns:
        ``steps``, ``specenv_ms`` and ``specenv_cpu_ms`` (sums), ``step_ms`` (sum of the steps' wall
        times), ``rows`` (the per-step log) and ``frac`` / ``cpu_frac`` (controller time / step time)
        with a 95% bootstrap interval over the steps (``frac_ci``, ``cpu_frac_ci``: [low, high]).
    """
    return overhead_of(ctl.step_log(since))


def overhead_of(log: np.ndarray) -> dict[str, Any]:
    """:func:`step_overhead`'s figures from a per-step log (rows ``(specenv_ms, specenv_cpu_ms, step_ms)``)."""
    log = np.asarray(log, dtype=np.float64).reshape(-1, 3) if len(log) else np.zeros((0, 3))
    n = len(log)
    out: dict[str, Any] = {"steps": n}
    if n == 0:
        return out
    over, cpu, wall = log[:, 0], log[:, 1], log[:, 2]
    out.update(specenv_ms=float(over.sum()), specenv_cpu_ms=float(cpu.sum()), step_ms=float(wall.sum()))
    rng = np.random.default_rng(0)
    idx = rng.integers(0, n, size=(500, n))
    for key, num in (("frac", over), ("cpu_frac", cpu)):
        out[key] = float(num.sum() / max(wall.sum(), 1e-12))
        boot = num[idx].sum(axis=1) / np.maximum(wall[idx].sum(axis=1), 1e-12)
        out[key + "_ci"] = [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))]
    out["rows"] = log.round(5).tolist()
    return out


def timed_pass(
    llm: Any, prompts: list[list[int]], max_tokens: int, batch: int = 1, ignore_eos: bool = False
) -> dict[str, Any]:
    """One greedy pass over ``prompts``, ``batch`` concurrent requests at a time (a *group*).

    The engine is stepped here (``llm_engine.step()``, as ``LLM.generate`` does) so that every
    request's first and last token are timed: TTFT is from the group's start to the step that
    returned the request's first token, TPOT the time from that step to its last token over the
    tokens in between.

    Returns:
        ``wall_s``, ``tokens``, ``tok_per_s``, ``steps`` (engine steps), ``outputs`` (token ids per
        prompt), ``groups`` (per group: ``wall_s`` and ``tokens``: the unit a paired bootstrap
        resamples), ``requests`` (per prompt: ``group``, ``ttft_ms``, ``tpot_ms`` (None for a single
        token), ``tokens``) and, on a controller engine, ``overhead`` (:func:`step_overhead` over
        the pass) and the controller's counters (``decisions``, ``fallbacks``, ``capped``).
    """
    from vllm import SamplingParams

    ctl = scheduler_of(llm)
    has_ctl = hasattr(ctl, "step_log")
    sp = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=bool(ignore_eos), detokenize=False)
    step0 = ctl.steps_logged if has_ctl else 0
    counts0 = {k: ctl.stats[k] for k in ("decisions", "fallbacks", "capped")} if has_ctl else {}
    engine = llm.llm_engine
    b = max(int(batch), 1)
    outputs: list[list[int]] = [[] for _ in prompts]
    requests: list[dict[str, Any]] = [{} for _ in prompts]
    groups: list[dict[str, Any]] = []
    steps = 0
    t0 = time.perf_counter()
    for g, i0 in enumerate(range(0, len(prompts), b)):
        members = {f"specenv-ab-{next(_PASS_IDS)}": i for i in range(i0, min(i0 + b, len(prompts)))}
        first: dict[str, float] = {}
        tg = time.perf_counter()
        for rid, i in members.items():
            engine.add_request(rid, {"prompt_token_ids": list(prompts[i])}, sp)
        while engine.has_unfinished_requests():
            outs = engine.step()
            steps += 1
            now = time.perf_counter()
            for out in outs:
                i = members.get(out.request_id)
                if i is None:
                    continue
                outputs[i] = list(out.outputs[0].token_ids)
                if outputs[i] and out.request_id not in first:
                    first[out.request_id] = now
                if out.finished:
                    n = len(outputs[i])
                    t1 = first.get(out.request_id, now)
                    requests[i] = {
                        "group": g,
                        "ttft_ms": (t1 - tg) * 1e3,
                        "tpot_ms": (now - t1) * 1e3 / (n - 1) if n > 1 else None,
                        "tokens": n,
                    }
        groups.append({"wall_s": time.perf_counter() - tg, "tokens": sum(len(outputs[i]) for i in members.values())})
    wall = time.perf_counter() - t0
    tokens = sum(len(o) for o in outputs)
    res: dict[str, Any] = {
        "wall_s": wall,
        "tokens": tokens,
        "tok_per_s": tokens / wall,
        "steps": steps,
        "outputs": outputs,
        "groups": groups,
        "requests": requests,
    }
    if has_ctl:
        res["overhead"] = step_overhead(ctl, step0)
        res.update({k: ctl.stats[k] - v for k, v in counts0.items()})
    return res


_PASS_IDS = itertools.count()


def join_passes(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One pass from :func:`timed_pass` results over consecutive slices of its prompts, in order.

    What the A/B does when it interleaves its arms group by group (each part one group of ``batch``
    requests): the joined pass is the pass the parts make together -- ``wall_s`` the sum of the parts'
    (the time between them, when other arms ran, is no part of this arm's pass), ``outputs`` and
    ``requests`` in prompt order (each request's ``group`` renumbered to its place in the whole pass),
    ``groups`` in order, the counters summed and ``overhead`` recomputed from the parts' per-step logs.

    Raises:
        ValueError: When ``parts`` is empty or only some parts come from a controller engine.
    """
    if not parts:
        raise ValueError("join_passes: no parts")
    wall = float(sum(p["wall_s"] for p in parts))
    tokens = int(sum(p["tokens"] for p in parts))
    out: dict[str, Any] = {
        "wall_s": wall,
        "tokens": tokens,
        "tok_per_s": tokens / wall if wall > 0 else 0.0,
        "steps": int(sum(p["steps"] for p in parts)),
        "outputs": [o for p in parts for o in p["outputs"]],
        "groups": [g for p in parts for g in p["groups"]],
        "requests": [],
    }
    g0 = 0
    for p in parts:
        out["requests"] += [{**r, "group": r["group"] + g0} if "group" in r else dict(r) for r in p["requests"]]
        g0 += len(p["groups"])
    has = ["overhead" in p for p in parts]
    if any(has) and not all(has):
        raise ValueError("join_passes: some parts come from a controller engine and some do not")
    if all(has):
        logs = [np.asarray(p["overhead"].get("rows", []), dtype=np.float64).reshape(-1, 3) for p in parts]
        out["overhead"] = overhead_of(np.concatenate(logs))
        for k in ("decisions", "fallbacks", "capped"):
            out[k] = int(sum(p.get(k, 0) for p in parts))
    return out


def run_config(cfg: dict[str, Any], make_policy: PolicyFactory | None = None) -> dict[str, Any]:
    """Start one engine in this process, run ``warmup + reps`` passes, return timings and outputs.

    ``cfg`` adds to the engine configuration: ``prompt_ids`` (and ``prompts``: the prompt set),
    ``max_tokens``, ``batch`` (concurrent requests; default ``max_num_seqs``), ``reps``, ``warmup``,
    ``ignore_eos`` and ``policy`` (a JSON description for ``make_policy``).
    """
    t0 = time.perf_counter()
    llm = build_llm(cfg)
    startup = time.perf_counter() - t0
    ctl = scheduler_of(llm)
    if cfg.get("policy") is not None:
        if make_policy is None:
            raise ValueError("a policy description needs a policy factory")
        ctl.set_policy(make_policy(cfg["policy"], ctl))
    prompts = encode_prompts(cfg["models"], cfg["prompt_ids"], cfg.get("prompts", "stdlib-code-v1"))
    batch = int(cfg.get("batch", cfg.get("max_num_seqs", 1)))
    passes = []
    for rep in range(cfg.get("reps", 1) + cfg.get("warmup", 0)):
        p = timed_pass(llm, prompts, cfg["max_tokens"], batch, cfg.get("ignore_eos", False))
        if rep >= cfg.get("warmup", 0):
            passes.append(p)
    res: dict[str, Any] = {
        "config": cfg,
        "startup_s": startup,
        "passes": [{k: v for k, v in p.items() if k != "outputs"} for p in passes],
        "tok_per_s": statistics.median(p["tok_per_s"] for p in passes),
        "wall_s": statistics.median(p["wall_s"] for p in passes),
        "tokens": passes[-1]["tokens"],
        "outputs": passes[-1]["outputs"],
    }
    if hasattr(ctl, "summary"):
        res["stats"] = ctl.summary()
        ctl.stop_recording()
    return res


def engine_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine process: in-process engine core, the CPU settings of :data:`ENGINE_ENV`."""
    env = dict(os.environ if environ is None else environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override engine_options' kv_cache_memory_bytes
    for k, v in ENGINE_ENV.items():
        env.setdefault(k, v)
    return with_hugepages(env)  # malloc on huge pages from the start (specenv.engines.vllm.hugepages)


class EngineError(RuntimeError):
    """An engine process failed (its log's last lines are in the message)."""


class EngineProcess:
    """One engine kept alive in a child process, answering JSON commands (:func:`worker_main`).

    Args:
        module: The module run as ``python -m MODULE _engine CFG`` (it calls :func:`worker_main`).
        cfg: The engine configuration (:func:`engine_options`).
        log: File that receives the process's output.
        timeout_s: Longest wait for one answer (start-up included).
        env: Extra environment variables of the process (e.g. ``PYTHONPATH`` of another source tree).
    """

    def __init__(
        self,
        module: str,
        cfg: dict[str, Any],
        log: Path,
        timeout_s: float = 1800.0,
        env: dict[str, str] | None = None,
    ):
        self.cfg, self.log, self.timeout_s = cfg, Path(log), timeout_s
        rfd, wfd = os.pipe()
        env = {**engine_env(), **(env or {})}
        env[FD_VAR] = str(wfd)
        self._logf = open(self.log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "_engine", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=self._logf,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(wfd,),
            text=True,
        )
        os.close(wfd)
        self._r = os.fdopen(rfd, "r")
        self.info: dict[str, Any] | None = None

    def ready(self) -> dict[str, Any]:
        """Wait for the engine to be up; its start-up facts (``startup_s``, ``rss_mb``)."""
        if self.info is None:
            self.info = self._answer()
        return self.info

    def call(self, **cmd: Any) -> dict[str, Any]:
        """Send one command (``op``: ``run``, ``policy``, ``record``, ``summary``), wait for the answer."""
        self.ready()
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise EngineError(self._died("the engine process is gone")) from None
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        ready, _, _ = select.select([self._r], [], [], self.timeout_s)
        line = self._r.readline() if ready else ""
        if not line:
            raise EngineError(self._died("no answer" if not ready else "the engine process exited"))
        ans = json.loads(line)
        if "error" in ans:
            raise EngineError(f"{self.log.stem}: {ans['error']}")
        return ans

    def _died(self, what: str) -> str:
        try:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-5:]
        except OSError:
            tail = []
        return f"{self.log.stem}: {what}; log {self.log}: " + " | ".join(tail)

    def close(self) -> None:
        """Ask the engine to exit (killed if it does not within 60 s)."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._r.close()
        self._logf.close()


def _rss_mb() -> float:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return float("nan")


def worker_main(cfg_json: str, make_policy: PolicyFactory | None = None) -> None:
    """The engine process of :class:`EngineProcess`: start the engine, then answer commands until ``quit``.

    Commands (one JSON object per line on stdin; one answer per line on the descriptor ``$SPECENV_BENCH_FD``):

    * ``{"op": "run", "prompt_ids": [...], "prompts": SET, "max_tokens": N, "batch": B, "ignore_eos": false}``:
      :func:`timed_pass`;
    * ``{"op": "policy", "policy": DESC or null, "draft_horizon": "max" | "policy"}``: install a policy
      (built by ``make_policy``); ``{"ok": true, "name": ...}`` or ``{"refused": "one line"}``;
    * ``{"op": "record", "folder": DIR or null}``: start (or stop) recording;
    * ``{"op": "summary"}``: the controller's counters.
    """
    out = os.fdopen(int(os.environ[FD_VAR]), "w")

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj, default=float) + "\n")
        out.flush()

    cfg = json.loads(cfg_json)
    try:
        t0 = time.perf_counter()
        llm = build_llm(cfg)
        advise_engine(llm)  # the weights as the started engine holds them, on huge pages
        startup = time.perf_counter() - t0
    except Exception as exc:
        answer({"error": f"engine start failed: {type(exc).__name__}: {exc}"})
        raise
    ctl = scheduler_of(llm)
    answer(
        {
            "startup_s": startup,
            "rss_mb": _rss_mb(),
            "controller": hasattr(ctl, "step_log"),
            "pages": backing(),  # this engine process's huge pages (specenv.engines.vllm.hugepages)
        }
    )
    encoded: dict[tuple[str, int], list[int]] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "quit":
                break
            if op == "run":
                pset = cmd.get("prompts", "stdlib-code-v1")
                need = [i for i in cmd["prompt_ids"] if (pset, i) not in encoded]
                for i, ids in zip(need, encode_prompts(cfg["models"], need, pset), strict=True):
                    encoded[(pset, i)] = ids
                prompts = [encoded[(pset, i)] for i in cmd["prompt_ids"]]
                answer(timed_pass(llm, prompts, cmd["max_tokens"], cmd.get("batch", 1), cmd.get("ignore_eos", False)))
            elif op == "policy":
                desc = cmd.get("policy")
                if "draft_horizon" in cmd:
                    ctl.settings.draft_horizon = cmd["draft_horizon"]
                try:
                    pol = None if desc is None else (make_policy(desc, ctl) if make_policy else None)
                    ctl.set_policy(pol)
                except ValueError as exc:
                    answer({"refused": str(exc)})
                    continue
                answer({"ok": True, "name": None if pol is None else str(getattr(pol, "name", type(pol).__name__))})
            elif op == "record":
                if cmd.get("folder"):
                    ctl.start_recording(cmd["folder"], **cmd.get("settings", {}))
                else:
                    ctl.stop_recording()
                answer({"ok": True})
            elif op == "summary":
                answer(ctl.summary() if hasattr(ctl, "summary") else {})
            else:
                answer({"error": f"unknown command {op!r}"})
        except Exception as exc:
            answer({"error": f"{op}: {type(exc).__name__}: {exc}"})
    if hasattr(ctl, "stop_recording"):
        ctl.stop_recording()
    out.close()
