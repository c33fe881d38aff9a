"""The recording of the ``rounds`` table (trace schema v1) while an engine serves: atomic part files.

The recorder is engine-agnostic: it records the rounds any engine executes (the vLLM controller,
:mod:`specenv.engines.vllm.controller`, feeds it while vLLM serves; another engine does the same by
calling :meth:`PartRecorder.add` once per round). The engine's name goes into the run manifest
(``source``) and from there into the trace set's manifest.

A recording is a folder::

    recording.json               run manifest: source engine, model facts, Kmax, settings (atomic)
    parts/part-000000.parquet    a complete Parquet file of rounds (schema v1 + extra columns)
    parts/part-000000.json       its index: rows, sha256, steps; written *after* the Parquet file
    ...

Every file is written to a hidden temporary sibling, flushed and fsync'ed, then renamed into place
with ``os.replace`` (atomic on POSIX). A part exists for readers only once its index is in place, and
the index carries the Parquet file's sha256, so a crash (even SIGKILL) loses at most the part in
progress, and nothing half-written is ever taken as valid: leftover temporaries and a Parquet file
without its index are ignored (and reported by :func:`recording_status`).

Writing happens on a background thread; the serving loop only appends values to column lists (under a
lock the writer shares). Nothing waits for the next round to be written: a part is handed over when it
holds ``part_rounds`` rows (by the serving loop), and the writer also writes whatever rows are older
than ``part_seconds`` (default 2 s) on its own, so an idle server has its finished rounds on disk
within ``part_seconds`` plus one tick. :meth:`PartRecorder.close` writes the rest (the vLLM controller
calls it from the scheduler's ``shutdown``, which vLLM reaches on SIGTERM/SIGINT and on normal exit; an
``atexit`` hook closes recorders left open at interpreter exit). :func:`chain_flush_on_signals` makes
SIGTERM/SIGINT also ask the writer for an immediate part. Loss window on SIGKILL: at most the rows of
the last ``part_seconds`` (plus one tick) and the part being written; hidden temporaries of writers that
no longer run are removed when the next recorder starts in the folder.

:func:`load_recording` assembles one or more recordings into an in-memory
:class:`specenv.traces.traceset.TraceSet` (rounds only; ``source`` = the recording engine) that validates;
``TraceSet.save`` writes it as an ordinary trace set (``specenv fit`` runs on it).

Extra columns (allowed by schema v1): ``request_id`` (the engine's id), ``t`` (tokens generated before the
round), ``step`` (engine step), ``batch_size`` and ``batch_tokens`` (requests and tokens of the
step), ``drafted`` (tokens the drafter proposed before the controller trimmed them to K), ``policy_k``
(the policy's choice, -1 without policy), ``fallback`` (the configured k was used because the policy
failed), ``capped`` (the policy's k exceeded the drafts available), ``greedy`` (temperature 0),
``step_ms`` (wall time of the engine step), ``T_T_cpu_ms``/``T_D_cpu_ms`` (CPU time of the
forwards' thread: robust to other processes on a shared machine; 0 without hooks), ``timing``
(``hooks``: T_T/T_D from forward hooks; ``events``: the same from CUDA events; ``step``: T_T is the
step's wall time and T_D missing; on an accelerator followed by the step's CUDA-graph mode, e.g.
``events:PIECEWISE``, ``step:FULL``),
``run``, ``accepted_raw`` (the drafts the verifier accepted, as vLLM's spec-decode counters count
them; ``accepted`` is capped where the engine cuts the request: ``max_tokens``, end-of-text or a stop
token, so a request's rounds never commit more tokens than it returned); with ``record_tokens`` also
``verified_tokens`` (the m token ids of the verification pass: last committed token + drafts).

``T_D_ms`` is the measured time of the drafting that produced the round's drafts (in vLLM it runs in
the previous engine step); when the drafter proposed more tokens than the round verifies
(``drafted > K``, e.g. K = 0 chosen by a policy) the server still paid for them, and ``T_D_ms``
says so.
"""

from __future__ import annotations

import atexit
import io
import os
import queue
import re
import signal
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from specenv.io import atomic_file, atomic_write_json, sha256_file
from specenv.traces.schema import ROUNDS_COLUMNS, SCHEMA_VERSION, ModelFacts, TraceError, validate_rounds

RUN_MANIFEST = "recording.json"
PARTS = "parts"
RUN_FORMAT = "specenv.recording/1"
PART_FORMAT = "specenv.recording.part/1"
#: Formats of recordings written by earlier releases (vLLM only; their ``source`` is ``vllm``), still read.
LEGACY_RUN_FORMATS = ("specenv.vllm.recording/1", "specenv.engines.vllm.recording/1")
LEGACY_PART_FORMATS = ("specenv.vllm.part/1", "specenv.engines.vllm.part/1")

#: Extra columns and their Arrow types, in file order after the schema's columns.
EXTRA_COLUMNS: dict[str, pa.DataType] = {
    "request_id": pa.string(),
    "t": pa.int32(),
    "step": pa.int64(),
    "batch_size": pa.int32(),
    "batch_tokens": pa.int32(),
    "drafted": pa.int32(),
    "policy_k": pa.int32(),
    "fallback": pa.bool_(),
    "capped": pa.bool_(),
    "greedy": pa.bool_(),
    "step_ms": pa.float32(),
    "T_T_cpu_ms": pa.float32(),
    "T_D_cpu_ms": pa.float32(),
    "timing": pa.string(),
    "run": pa.string(),
    "accepted_raw": pa.int32(),
}
COLUMNS: dict[str, pa.DataType] = {**ROUNDS_COLUMNS, **EXTRA_COLUMNS}
TOKENS_COLUMN = "verified_tokens"
#: Default age (seconds) of the oldest buffered row at which the writer writes a part on its own.
PART_SECONDS = 2.0
#: Longest sleep of the writer thread between looks at the buffer (seconds).
WRITER_TICK = 0.25
#: A hidden temporary of :func:`specenv.io.atomic_file`: ``.<name>.<pid>.<hex>.tmp``.
_TEMPORARY = re.compile(r"^\..+\.(\d+)\.[0-9a-f]+\.tmp$")


class PartRecorder:
    """Buffers round rows and writes them as atomic Parquet parts on a background thread.

    The serving loop calls :meth:`add` (and :meth:`maybe_flush`); the writer thread writes a part when
    the serving loop hands one over, when the oldest buffered row is ``part_seconds`` old (also when no
    further round comes: an idle server loses nothing), and when :meth:`request_flush` was called
    (signal-safe). :meth:`close` writes everything that is left.

    Args:
        folder: Recording folder (created). If it already holds a recording, new parts continue
            its numbering (the run manifest is rewritten with the union of both runs' metadata);
            hidden temporaries that writers no longer running left in ``parts/`` are removed.
        facts: Routing facts of the target (MoE layers, experts, top-k).
        source: The engine that executes the rounds (``"vllm"``, ``"hf"``, ...): the trace set's
            ``source``.
        kmax: Largest budget (``num_speculative_tokens``).
        meta: Provenance written to ``recording.json`` (``extra``).
        name: Name of the recording.
        max_new_tokens: Generation cap recorded in the manifest.
        part_rounds: Rows per part.
        part_seconds: Also write a part when the oldest buffered row is this many seconds old: the
            bound of what SIGKILL can lose (plus :data:`WRITER_TICK` and the part being written).
        with_tokens: Also record the verified token ids (column ``verified_tokens``).
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        facts: ModelFacts,
        kmax: int,
        meta: dict[str, Any],
        *,
        source: str,
        name: str = "recording",
        max_new_tokens: int = 1000,
        part_rounds: int = 2048,
        part_seconds: float = PART_SECONDS,
        with_tokens: bool = False,
    ):
        if not part_seconds > 0:
            raise ValueError(f"part_seconds={part_seconds}: must be > 0")
        self.folder = Path(folder)
        self.parts_dir = self.folder / PARTS
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        self.facts = facts
        self.kmax = int(kmax)
        self.part_rounds = int(part_rounds)
        self.part_seconds = float(part_seconds)
        self.columns = dict(COLUMNS)
        if with_tokens:
            self.columns[TOKENS_COLUMN] = pa.list_(pa.int32())
        #: Hidden temporaries of dead writers removed at start (names).
        self.removed_temporaries = remove_dead_temporaries(self.parts_dir)
        existing = sorted(self.parts_dir.glob("part-*.json"))
        self.next_part = 1 + max((int(p.stem.split("-")[1]) for p in existing), default=-1)
        self.run_manifest = {
            "format": RUN_FORMAT,
            "schema_version": SCHEMA_VERSION,
            "source": str(source),
            "name": name,
            "model": {"n_layers": facts.n_layers, "n_experts": facts.n_experts, "top_k": facts.top_k},
            "kmax": self.kmax,
            "max_new_tokens": int(max_new_tokens),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "extra": meta,
        }
        old = self.folder / RUN_MANIFEST
        if old.is_file():
            prev = read_run_manifest(old)  # one line (TraceError) for a corrupt or foreign recording.json
            if prev.get("model") != self.run_manifest["model"]:
                raise ValueError(f"{old}: recording of another model ({prev.get('model')}); use a new folder")
            if _source(prev) != self.run_manifest["source"]:
                raise ValueError(f"{old}: recording of another engine ({_source(prev)!r}); use a new folder")
            self.run_manifest["kmax"] = max(self.kmax, int(prev.get("kmax", 0)))
            self.run_manifest["previous_runs"] = [*prev.get("previous_runs", []), prev.get("extra", {})]
        atomic_write_json(old, self.run_manifest, fsync=True)
        # The buffer and the part numbering are shared by the serving loop and the writer thread.
        self._lock = threading.Lock()
        self._cols: dict[str, list[Any]] = {c: [] for c in self.columns}
        self._deferred: list[
            tuple[int, int, Callable[[], list[dict[str, Any]]]]
        ] = []  # (rows of _cols before, n, build)
        self._oldest = 0.0  # time.monotonic() of the oldest buffered row
        self._flush_requested = False  # set by request_flush (a plain store: safe in a signal handler)
        self._queue: queue.Queue[tuple[int, dict[str, list[Any]], list[Any]] | None] = queue.Queue()
        self.rows_buffered = 0
        self.rows_written = 0
        self.parts_written = 0
        self.errors: list[str] = []
        self._closed = False
        self._thread = threading.Thread(target=self._writer, name="specenv-recorder", daemon=True)
        self._thread.start()
        self._at_exit = _CloseAtExit(self)
        atexit.register(self._at_exit)

    # ------------------------------------------------------------------ serving side
    def add(self, row: dict[str, Any]) -> None:
        """Append one round (keys: every column of :attr:`columns`)."""
        values = [row[c] for c in self.columns]  # a missing key raises before anything is appended
        with self._lock:
            if not self.rows_buffered:
                self._oldest = time.monotonic()
            for col, v in zip(self._cols.values(), values, strict=True):
                col.append(v)
            self.rows_buffered += 1

    def add_deferred(self, n: int, build: Callable[[], list[dict[str, Any]]]) -> None:
        """Append ``n`` rounds whose rows ``build()`` makes later, on the writer thread.

        The serving loop hands over what it already holds (``build`` must capture values, never state
        that changes afterwards); building the row dicts and checking their keys happen when the part is
        written. A ``build`` that fails or returns another number of rows loses its part (the error is
        kept in :attr:`errors` and the run summary), never the server.
        """
        with self._lock:
            if not self.rows_buffered:
                self._oldest = time.monotonic()
            self._deferred.append((len(self._cols["step"]), int(n), build))
            self.rows_buffered += n

    def maybe_flush(self) -> None:
        """Hand the buffer to the writer when it is full or old enough (the writer also does the latter)."""
        n = self.rows_buffered
        if n >= self.part_rounds or (n and time.monotonic() - self._oldest >= self.part_seconds):
            self.flush()

    def flush(self) -> None:
        """Hand whatever is buffered to the writer thread as one part (any thread; not a signal handler)."""
        with self._lock:
            if not self.rows_buffered:
                return
            cols, self._cols = self._cols, {c: [] for c in self.columns}
            deferred, self._deferred = self._deferred, []
            # numbered and queued under the lock: parts are written in the order their rows came
            self._queue.put((self.next_part, cols, deferred))
            self.next_part += 1
            self.rows_buffered = 0

    def request_flush(self) -> None:
        """Ask the writer thread to write what is buffered within one tick (safe in a signal handler)."""
        self._flush_requested = True

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Write the last part, wait for the writer, and record the run summary (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        self.flush()
        self._queue.put(None)
        self._thread.join()
        # what the writer's own last flush queued behind the stop mark, and rows added meanwhile
        self.flush()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._write_job(job)
        self.run_manifest["closed_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.run_manifest["summary"] = {
            "rows": self.rows_written,
            "parts": self.parts_written,
            "errors": self.errors,
            **(summary or {}),
        }
        atomic_write_json(self.folder / RUN_MANIFEST, self.run_manifest, fsync=True)

    # ------------------------------------------------------------------ writer thread
    def _writer(self) -> None:
        self._warm_up()
        while True:
            try:
                job = self._queue.get(timeout=min(WRITER_TICK, self.part_seconds))
            except queue.Empty:
                job = ()
            if job is None:
                return
            if job:
                self._write_job(job)
            if self._flush_requested or (self.rows_buffered and time.monotonic() - self._oldest >= self.part_seconds):
                self._flush_requested = False
                self.flush()  # queued: written at the next turn of the loop, before any sleep

    def _warm_up(self) -> None:
        """Write an empty part to memory, so that the write path's lazy imports happen now.

        pyarrow loads pandas on first use, which registers an exit hook: at interpreter exit (a last part
        written by the ``atexit`` hook) that import fails.
        """
        try:
            pq.write_table(
                columns_to_table({c: [] for c in self.columns}, self.columns), io.BytesIO(), compression="zstd"
            )
        except Exception as exc:  # the real parts will report it
            self.errors.append(f"warm-up: {exc.__class__.__name__}: {exc}")

    def _write_job(self, job: tuple[int, dict[str, list[Any]], list[Any]]) -> None:
        index, cols, deferred = job
        try:
            self._write_part(index, self._merged(cols, deferred))
        except Exception as exc:  # never take the server down; keep the message
            self.errors.append(f"part {index}: {exc.__class__.__name__}: {exc}")

    def _merged(self, cols: dict[str, list[Any]], deferred: list[Any]) -> dict[str, list[Any]]:
        """The part's columns: the rows added directly, with the deferred ones built in their places."""
        if not deferred:
            return cols
        names = list(self.columns)
        out: dict[str, list[Any]] = {c: [] for c in names}
        lists = list(out.values())
        done = 0
        for pos, n, build in [*deferred, (len(cols["step"]), 0, None)]:
            if pos > done:
                for col, src in zip(lists, cols.values(), strict=True):
                    col.extend(src[done:pos])
                done = pos
            if build is not None:
                rows = build()
                if len(rows) != n:
                    raise ValueError(f"a deferred build made {len(rows)} rows, {n} announced")
                for row in rows:
                    for col, c in zip(lists, names, strict=True):
                        col.append(row[c])
        return out

    def _write_part(self, index: int, cols: dict[str, list[Any]]) -> None:
        table = columns_to_table(cols, self.columns)
        name = f"part-{index:06d}"
        try:
            validate_rounds(table, self.facts, self.run_manifest["kmax"], file=f"{name} (in memory)")
        except TraceError as exc:
            self.errors.append(str(exc))
            name = f"rejected-{index:06d}"  # kept for inspection, never read as a part
        pq_path = self.parts_dir / f"{name}.parquet"
        with atomic_file(pq_path, fsync=True) as tmp:
            pq.write_table(table, tmp, compression="zstd")
        if name.startswith("rejected"):
            return
        steps = cols["step"]
        atomic_write_json(
            self.parts_dir / f"{name}.json",
            {
                "format": PART_FORMAT,
                "part": index,
                "path": pq_path.name,
                "sha256": sha256_file(pq_path),
                "rows": table.num_rows,
                "first_step": int(min(steps)),
                "last_step": int(max(steps)),
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            fsync=True,
        )
        self.rows_written += table.num_rows
        self.parts_written += 1


class _CloseAtExit:
    """``atexit`` hook that closes a recorder still open when the interpreter exits (weak reference)."""

    def __init__(self, recorder: PartRecorder):
        self._ref = weakref.ref(recorder)

    def __call__(self) -> None:
        rec = self._ref()
        if rec is not None:
            rec.close(summary={"closed_by": "atexit"})


def remove_dead_temporaries(folder: Path) -> list[str]:
    """Remove the hidden temporaries (``.<name>.<pid>.<hex>.tmp``) that a process no longer running left.

    A temporary of a live process (a writer still at work) is kept; so is a name without a process id.

    Returns:
        The names removed.
    """
    removed = []
    for p in folder.glob(".*.tmp"):
        m = _TEMPORARY.match(p.name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            p.unlink()
        except FileNotFoundError:
            continue
        removed.append(p.name)
    return sorted(removed)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or not a process id at all
        return True
    return True


def chain_flush_on_signals(
    recorder_of: Callable[[], PartRecorder | None], signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
) -> list[int]:
    """Make SIGTERM/SIGINT ask the current recorder for an immediate part, then run the handler in place.

    Only signals whose handler a program installed are chained (e.g. vLLM's engine-core handler, which
    then shuts the engine down and so closes the recording); the default action, Python's own SIGINT
    handler (KeyboardInterrupt) and ignored signals are left alone. Call from the main thread.

    Args:
        recorder_of: Returns the recorder to flush (or None), called inside the signal handler (so it
            must not take locks).
        signals: The signals to chain.

    Returns:
        The signals chained.
    """
    if threading.current_thread() is not threading.main_thread():
        return []
    chained = []
    for sig in signals:
        prev = signal.getsignal(sig)
        if not callable(prev) or prev is signal.default_int_handler:
            continue

        def handler(signum: int, frame: Any, prev: Callable[..., Any] = prev) -> None:
            rec = recorder_of()
            if rec is not None:
                rec.request_flush()
            prev(signum, frame)

        signal.signal(sig, handler)
        chained.append(int(sig))
    return chained


def columns_to_table(cols: dict[str, list[Any]], columns: dict[str, pa.DataType] | None = None) -> pa.Table:
    """Column lists -> Arrow table with the schema-v1 types and the schema-version metadata."""
    columns = COLUMNS if columns is None else columns
    arrays = [pa.array(cols[c], type=t) for c, t in columns.items()]
    schema = pa.schema(
        [pa.field(c, t) for c, t in columns.items()], metadata={b"specenv.schema_version": str(SCHEMA_VERSION).encode()}
    )
    return pa.Table.from_arrays(arrays, schema=schema)


# ---------------------------------------------------------------------- reading
def read_run_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A recording's ``recording.json``, checked by :mod:`specenv.validation` (``RecordingJSON``).

    Raises:
        TraceError: One line naming the file and the field (not JSON, duplicate keys, another
            format, no or bad ``model``, kmax outside 1..64, ...).
    """
    from specenv.validation import check, read_json

    obj = read_json(path, TraceError, what="recording manifest")
    formats = (RUN_FORMAT, *LEGACY_RUN_FORMATS)
    check("RecordingJSON", obj, str(path), TraceError, formats=formats, what="specenv recording")
    return obj


def read_part_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A part index, checked (``PartIndexJSON``): its ``path`` must be a plain file name in ``parts/``.

    Raises:
        TraceError: One line naming the index file and the field (a path with ``../`` or an
            absolute path is refused, never followed).
    """
    from specenv.validation import check, read_json

    obj = read_json(path, TraceError, what="part index")
    formats = (PART_FORMAT, *LEGACY_PART_FORMATS)
    check("PartIndexJSON", obj, str(path), TraceError, formats=formats, what="specenv recording part index")
    return obj


def recording_status(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """What a recording folder holds: valid parts, and anything that would not be read.

    Returns:
        ``parts`` (valid part names), ``rows``, ``incomplete`` (temporaries and Parquet files
        without an index), ``invalid`` (index files that are malformed, or whose Parquet file is
        missing or has another sha256), ``malformed`` (the malformed ones: index name -> the one-line
        reason), ``rejected`` (parts that failed validation when written).
    """
    folder = Path(folder)
    pdir = folder / PARTS
    valid, invalid, rows = [], [], 0
    malformed: dict[str, str] = {}
    indexed = set()
    for idx in sorted(pdir.glob("part-*.json")):
        indexed.add(f"{idx.stem}.parquet")
        try:
            ent = read_part_index(idx)
        except TraceError as exc:
            malformed[idx.name] = str(exc)
            invalid.append(idx.name)
            continue
        indexed.add(ent["path"])
        path = pdir / ent["path"]
        try:
            ok = path.is_file() and sha256_file(path) == ent["sha256"]
        except OSError:
            ok = False
        if ok:
            valid.append(idx.stem)
            rows += int(ent["rows"])
        else:
            invalid.append(idx.name)
    incomplete = sorted(p.name for p in pdir.glob(".*")) + sorted(
        p.name for p in pdir.glob("part-*.parquet") if p.name not in indexed
    )
    rejected = sorted(p.name for p in pdir.glob("rejected-*.parquet"))
    return {
        "parts": valid,
        "rows": rows,
        "incomplete": incomplete,
        "invalid": invalid,
        "malformed": malformed,
        "rejected": rejected,
    }


def load_recording(
    folders: str | os.PathLike[str] | list[str | os.PathLike[str]], name: str | None = None, category: str | None = None
) -> Any:
    """Assemble the valid parts of one or more recordings into a validated in-memory TraceSet.

    Several folders (e.g. the fixed-K runs of a collection) must record the same model; their
    rounds are concatenated (generation ids as recorded, the ``run`` column tells runs apart) and
    Kmax is the largest of theirs. Parts whose Parquet file is missing or differs from its index
    (what a crash or a later edit leaves) are skipped and listed in ``extra["skipped_files"]``; a
    malformed index (not JSON, wrong fields, a path outside ``parts/``) is refused.

    Args:
        folders: Recording folder(s).
        name: Name of the trace set (default: the first recording's name).
        category: Override the ``category`` column (default: as recorded).

    Returns:
        A :class:`specenv.traces.traceset.TraceSet` with a rounds table; its ``source`` is the recording
        engine's.

    Raises:
        TraceError: One line naming the file and the problem (no or bad run manifest, a malformed
            part index, no valid part, different models or engines, a part that breaks the schema).
    """
    if isinstance(folders, (str, os.PathLike)):
        folders = [folders]
    folders = [Path(f) for f in folders]
    manifests = _read_run_manifests(folders)
    tables: list[pa.Table] = []
    skipped: list[str] = []
    for f in folders:
        parts, skip = _read_parts(f)
        tables += parts
        skipped += skip
    if not tables:
        raise TraceError(str(folders[0]), "recording holds no complete part yet")
    return _assemble(folders, manifests, tables, skipped, name, category)


def _read_run_manifests(folders: list[Path]) -> list[dict[str, Any]]:
    """The checked run manifests of ``folders``, which must record one model with one engine."""
    manifests: list[dict[str, Any]] = []
    for f in folders:
        mpath = f / RUN_MANIFEST
        if not mpath.is_file():
            raise TraceError(str(mpath), "missing recording manifest (not a specenv recording)")
        man = read_run_manifest(mpath)
        if manifests and man["model"] != manifests[0]["model"]:
            raise TraceError(str(mpath), f"records another model ({man['model']} vs {manifests[0]['model']})")
        if manifests and _source(man) != _source(manifests[0]):
            raise TraceError(str(mpath), f"records another engine ({_source(man)!r} vs {_source(manifests[0])!r})")
        manifests.append(man)
    return manifests


def _read_parts(folder: Path) -> tuple[list[pa.Table], list[str]]:
    """The tables of a recording's valid parts, and the files that were skipped."""
    st = recording_status(folder)
    for idx in st["malformed"]:
        read_part_index(folder / PARTS / idx)  # raises the one-line TraceError naming the index and field
    skipped = [f"{folder}/{PARTS}/{x}" for x in st["incomplete"] + st["invalid"] + st["rejected"]]
    tables = []
    for part in st["parts"]:
        ent = read_part_index(folder / PARTS / f"{part}.json")
        path = folder / PARTS / ent["path"]
        try:
            tables.append(pq.read_table(path))
        except (pa.ArrowException, OSError) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
            raise TraceError(str(path), f"not a readable Parquet file ({msg})") from None
    return tables, skipped


def _assemble(
    folders: list[Path],
    manifests: list[dict[str, Any]],
    tables: list[pa.Table],
    skipped: list[str],
    name: str | None,
    category: str | None,
) -> Any:
    """One validated in-memory TraceSet (rounds only) from the parts of every recording."""
    import pandas as pd

    from specenv.traces.traceset import Manifest, TraceSet

    first = manifests[0]
    facts = ModelFacts(**first["model"])
    kmax = max(int(m["kmax"]) for m in manifests)
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowException as exc:
        raise TraceError(str(folders[0]), f"parts do not share one schema ({str(exc).splitlines()[0]})") from None
    validate_rounds(table, facts, kmax, file=f"{folders[0]} (assembled)")
    df: pd.DataFrame = table.to_pandas()
    if category is not None:
        df["category"] = category
    greedy = bool(np.all(df["greedy"].to_numpy())) if "greedy" in df else False
    extra = {
        "recordings": [str(f) for f in folders],
        "runs": [m.get("extra", {}) for m in manifests],
        "skipped_files": skipped,
    }
    source = _source(first)
    man = Manifest(
        name=name or first.get("name", "recording"),
        source=source,
        profile=str(first.get("extra", {}).get("engine", source)),
        model=facts,
        kmax=kmax,
        greedy=greedy,
        description=f"Rounds of the {source} engine recorded by specenv's recorder (specenv.engines.recorder).",
        max_new_tokens=int(first.get("max_new_tokens", 1000)),
        extra=extra,
    )
    man.counts = {"rounds": len(df), "generations": int(df["generation_id"].nunique())}
    return TraceSet(man, positions=None, rounds=df)


def _source(run_manifest: dict[str, Any]) -> str:
    """The recording engine of a run manifest (recordings of earlier releases came from vLLM)."""
    return str(run_manifest.get("source", "vllm"))
