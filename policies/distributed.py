"""Ray as the one distributed engine of specenv: ``specenv bench|oracle|train --ray [ADDRESS]``.

Ray is an optional extra (``pip install "specenv[ray]"``): this module imports it only inside its
functions (:func:`ray_module`), and nothing on the ``import specenv`` path imports this module.

The units each command fans out, and why the outputs equal the local run's:

* **bench** -- (policy row, chunk of test generations): :func:`policies.bench.single.run_unit` in a
  Ray task. Episode r of generation g is reset with its own seed ``episode_seeds(seed, g, r)`` and a
  stream of the vector environment depends on nothing but its seed and generation, so the chunks,
  concatenated in the test split's order, are exactly the frame of the local run
  (:func:`policies.bench.single.run_policy`). The exact rows (fixed k, the oracle bound) and the
  statistics run in the driver, as locally. A worker rebuilds the run's context from its plain
  :class:`policies.bench.single.BenchSetup` once per process (every train-split fit is deterministic).
* **oracle** -- the Kmax sweep's units (:func:`oracle.sweep.sweep_solve` per Kmax,
  :func:`oracle.sweep.sweep_fixed` per fixed budget): :func:`ray_map_calls`. The positions table
  goes to the object store once. The main bound, its Monte Carlo and the delta-space analysis run in
  the driver while the sweep runs in the cluster.
* **train** -- independent runs (learner x seed, :class:`policies.learn.runs.TrainRun`): :func:`ray_train`.
  A worker trains into a temporary folder of its own and returns the run folder's files, which the
  driver writes into ``--out`` (so a remote cluster needs no shared filesystem for the outputs).
  Every learner runs torch on one thread, so on a local cluster a run is bit-identical to the local
  one (tested for DAgger, PPO, DQN); on other hardware results agree within seed variance.

Every task returns plain tables or bytes through Ray's object store (Ray serialises them in transit);
nothing is stored with pickle. Trace sets are read by each worker by name (registered sets ship in
the package) or by folder path (a folder must be visible at the same path on every node, e.g. a shared
filesystem). Ray Data is not used: a trace set is one or two Parquet files of a few MB, read by pyarrow
in 0.05 s where ``ray.data.read_parquet`` took 3.9 s here (``scripts/bench_ray.py``); the replay tables hold the whole
positions table in numpy anyway. It would help only for trace sets that do not fit a worker.

``ADDRESS``: ``local`` (what a bare ``--ray`` means) starts a local cluster with ``num_cpus`` CPUs (default:
every core); anything else (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``) connects to a running
cluster. A process that already called ``ray.init`` (a test, a notebook) keeps its cluster.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

#: Units of work per CPU of the cluster the automatic chunking of ``bench --ray`` aims at.
UNITS_PER_CPU = 2
#: The smallest chunk of test generations of the automatic chunking (smaller chunks cost more than they save).
MIN_CHUNK = 4
#: The address of a local cluster started by specenv (what a bare ``--ray`` means).
LOCAL = "local"


class RayUnavailable(ValueError):
    """Ray is not installed, or the cluster at the address cannot be reached (the message is one line)."""


def ray_module() -> Any:
    """The ``ray`` module, or :class:`RayUnavailable` naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable('--ray: Ray is not installed (pip install "specenv[ray]")') from None
    return ray


@contextmanager
def ray_cluster(address: str, num_cpus: int | None = None) -> Iterator[Any]:
    """Connect to (or start) the cluster of ``--ray ADDRESS``; shut down on exit only what this started.

    Args:
        address: ``"local"`` starts a local cluster; any other value is passed to ``ray.init(address=...)``.
        num_cpus: CPUs of a local cluster (default: every core); ignored when connecting.

    Raises:
        RayUnavailable: Ray is missing or the address cannot be reached (one line naming the address).
    """
    ray = ray_module()
    if address != LOCAL:
        check_address(address)
    if ray.is_initialized():
        yield ray
        return
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    saved = os.environ.get("PYTHONPATH")
    try:
        # Ray logs to fd 2 while it starts or connects (its core's retries, the token-auth notice of a local
        # start): held, and shown only if it succeeds, so that a failure is the one error line
        with _stderr_held() as held:
            if address == LOCAL:
                # the workers of a local cluster inherit the driver's environment when it starts: with the
                # folders of this checkout on PYTHONPATH they import the same code (no runtime_env to build)
                os.environ["PYTHONPATH"] = os.pathsep.join(_code_path())
                ray.init(num_cpus=num_cpus or os.cpu_count() or 1, **kw)
            else:
                ray.init(address=address, **kw)
        held.release()
    except Exception as exc:  # ConnectionError, ValueError, RuntimeError: Ray raises several for a bad address
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RayUnavailable(f"--ray: cannot connect to the Ray cluster at {address!r}: {first}") from None
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        yield ray
    finally:
        ray.shutdown()


class _Held:
    """What :func:`_stderr_held` caught: :meth:`release` writes it to the real stderr."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()

    def release(self) -> None:
        self.file.seek(0)
        data = self.file.read()
        self.file.close()
        if data:
            sys.stderr.flush()
            os.write(2, data)


@contextmanager
def _stderr_held() -> Iterator[_Held]:
    """Redirect file descriptor 2 (C++ libraries log there, past Python) into a temporary file for the block.

    The caught text is dropped unless the caller releases it: a failure is then one line, not a
    page of a library's retry warnings before it.
    """
    held = _Held()
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(held.file.fileno(), 2)
    try:
        yield held
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


#: Seconds a ``HOST:PORT`` address may take to accept a TCP connection (Ray itself would retry for minutes).
CONNECT_TIMEOUT_S = 5.0


def check_address(address: str) -> None:
    """Fail fast on a cluster address that cannot work: a malformed one, or no server at ``HOST:PORT``.

    ``auto`` is left to Ray (it fails at once when no cluster runs on this machine). For ``HOST:PORT`` and
    ``ray://HOST:PORT`` a TCP connection is tried first, since ``ray.init`` would retry for minutes.

    Raises:
        RayUnavailable: One line naming the address.
    """
    import socket

    if address == "auto":
        return
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayUnavailable(
            f"--ray: {address!r} is not a cluster address (expected auto, HOST:PORT or ray://HOST:PORT)"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise RayUnavailable(f"--ray: cannot connect to the Ray cluster at {address!r}: {reason}") from None


def _code_path() -> list[str]:
    """The folders the packages specenv, policies and oracle are imported from (for local workers)."""
    import oracle
    import specenv

    roots = {str(Path(m.__file__).resolve().parents[1]) for m in (specenv, oracle) if m.__file__}
    roots.add(str(Path(__file__).resolve().parents[1]))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return sorted(roots) + [p for p in extra if p not in roots]


def cluster_cpus(ray: Any) -> int:
    """CPUs of the connected cluster (at least 1)."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def chunks(ids: np.ndarray, size: int) -> list[np.ndarray]:
    """``ids`` cut into consecutive chunks of ``size`` (the last may be shorter), order kept."""
    if size < 1:
        raise ValueError(f"--ray-chunk: must be >= 1, got {size}")
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def auto_chunk(n_generations: int, n_rows: int, cpus: int) -> int:
    """Generations per bench unit: about :data:`UNITS_PER_CPU` units per CPU, chunks of at least :data:`MIN_CHUNK`."""
    per_row = max(1, math.ceil(UNITS_PER_CPU * cpus / max(n_rows, 1)))
    return max(min(MIN_CHUNK, n_generations), math.ceil(n_generations / per_row))


# --------------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------------

_SETUPS: dict[Any, Any] = {}  # per worker process: (BenchSetup, run token) -> (context, entries)


def _bench_unit(setup: Any, token: str, index: int, generation_ids: np.ndarray, episodes: int, seed: int) -> Any:
    """Ray task body: one (row, chunk) unit of the benchmark; the context is built once per process and run.

    ``token`` is new for every benchmark run, so a worker reused by a later run (a notebook, a long-lived
    cluster) rebuilds the context and sees policy files changed in between.
    """
    from policies.bench.single import run_unit, setup_entries

    key = (setup, token)
    if key not in _SETUPS:
        _SETUPS.clear()
        _SETUPS[key] = setup_entries(setup)
    ctx, entries = _SETUPS[key]
    return run_unit(ctx, entries, index, generation_ids, episodes, seed)


def bench_executor(
    chunk: int | None = None, progress: Callable[[int, int, str], None] | None = None
) -> Callable[..., dict[int, Any]]:
    """An executor for :func:`policies.bench.single.run_benchmark` that runs its Monte-Carlo rows as Ray tasks.

    Ray must be initialised (:func:`ray_cluster`).

    Args:
        chunk: Test generations per unit (None: :func:`auto_chunk` for the cluster's CPUs).
        progress: ``progress(done, total, name)`` as units finish.
    """

    def execute(
        setup: Any, rows: list[tuple[int, str]], generation_ids: np.ndarray, episodes: int, seed: int
    ) -> dict[int, Any]:
        ray = ray_module()
        size = chunk or auto_chunk(len(generation_ids), len(rows), cluster_cpus(ray))
        parts = chunks(np.asarray(generation_ids, dtype=np.int64), size)
        task = ray.remote(num_cpus=1)(_bench_unit)
        token = uuid.uuid4().hex
        refs, owner = [], {}
        for index, name in rows:
            for part in parts:
                ref = task.remote(setup, token, index, part, episodes, seed)
                refs.append(ref)
                owner[ref] = (index, name)
        results: dict[Any, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            results[ready[0]] = ray.get(ready[0])
            if progress:
                progress(len(results), len(refs), owner[ready[0]][1])
        out: dict[int, Any] = {}
        for index, _ in rows:
            got = [results[r] for r in refs if owner[r][0] == index]
            errors = [g for g in got if isinstance(g, str)]
            if errors:
                out[index] = errors[0]
            else:
                import pandas as pd

                out[index] = pd.concat(got, ignore_index=True)
        return out

    return execute


# --------------------------------------------------------------------------------------------------
# oracle (and any list of independent calls)
# --------------------------------------------------------------------------------------------------


def _call(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


def ray_map_calls(calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
    """Run ``[(function, args), ...]`` as Ray tasks; results in order (:data:`oracle.sweep.MapCalls`).

    Large arguments (the positions table, the cost model) shared by several calls go to the object
    store once. Ray must be initialised.
    """
    ray = ray_module()
    shared: dict[int, Any] = {}
    for _, args in calls:
        for a in args:
            if not isinstance(a, int | float | str | type(None)) and id(a) not in shared:
                shared[id(a)] = ray.put(a)
    task = ray.remote(num_cpus=1)(_call)
    refs = [task.remote(f, *[shared.get(id(a), a) for a in args]) for f, args in calls]
    return list(ray.get(refs))


# --------------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------------


def _train_task(run: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Ray task body: train ``run`` in a temporary folder; (summary, {relative path: bytes})."""
    import shutil

    from policies.learn.runs import train_run

    tmp = Path(tempfile.mkdtemp(prefix="specenv-ray-train-"))
    try:
        folder = tmp / run.name
        summary = train_run(run, folder)
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return summary, files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the folder this task created, nothing else


def ray_train(
    runs: list[Any], out_dir: Path, progress: Callable[[int, int, str], None] | None = None
) -> list[dict[str, Any]]:
    """Train ``runs`` (:class:`policies.learn.runs.TrainRun`) as Ray tasks; write each run folder under ``out_dir``.

    The files are written atomically, each in place of the file of the same name (as the local run
    does); the ``policy`` path of each summary names the folder under ``out_dir``. Ray must be initialised.

    Returns:
        The summaries, in the order of ``runs``.

    Raises:
        ValueError: The first learner error (one line), after every run has finished.
    """
    from specenv.io import atomic_write_bytes

    ray = ray_module()
    task = ray.remote(num_cpus=1)(_train_task)
    refs = [task.remote(r) for r in runs]
    done: dict[Any, Any] = {}
    error: str | None = None
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            done[ready[0]] = ray.get(ready[0])
        except Exception as exc:  # a RayTaskError wrapping the learner's ValueError
            cause = getattr(exc, "cause", None) or exc
            error = error or (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
        if progress:
            progress(len(done), len(refs), runs[refs.index(ready[0])].name)
    if error is not None:
        raise ValueError(error)
    summaries = []
    for run, ref in zip(runs, refs, strict=True):
        summary, files = done[ref]
        folder = out_dir / run.name
        for rel, data in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(folder / rel, data)
        summaries.append(summary | {"policy": str(folder / "policy")})
    return summaries


# --------------------------------------------------------------------------------------------------
# collection: one engine per actor (per GPU), over a shard each
# --------------------------------------------------------------------------------------------------


def shard(items: list[Any], n: int) -> list[list[Any]]:
    """``items`` cut into ``n`` consecutive shards of sizes differing by at most one (order kept)."""
    if n < 1:
        raise ValueError(f"shards: must be >= 1, got {n}")
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def ray_shards(
    function: Callable[..., Any], shards: list[dict[str, Any]], num_gpus: float = 0.0, num_cpus: float = 1.0
) -> list[Any]:
    """Run ``function(**kwargs)`` for every shard in an actor of its own (one engine per GPU); results in order.

    Each actor holds ``num_gpus`` GPUs (Ray sets its ``CUDA_VISIBLE_DEVICES``) and ``num_cpus`` CPUs for
    the whole shard, so an engine never shares a device; the actors are killed at the end. What
    ``function`` returns comes back through the object store (a trace set, a recording's files).
    Ray must be initialised.

    Raises:
        ValueError: The first shard's error, one line naming the shard.
    """
    ray = ray_module()

    class ShardWorker:
        """One engine's process: runs its shard."""

        def run(self, function: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
            return function(**kwargs)

    actor = ray.remote(ShardWorker)
    actors = [actor.options(num_gpus=num_gpus, num_cpus=num_cpus).remote() for _ in shards]
    try:
        refs = [a.run.remote(function, kw) for a, kw in zip(actors, shards, strict=True)]
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except Exception as exc:  # a RayTaskError wrapping the shard's own error
                cause = getattr(exc, "cause", None) or exc
                line = (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
                raise ValueError(f"shard {i}: {line}") from None
        return out
    finally:
        for a in actors:
            ray.kill(a)
