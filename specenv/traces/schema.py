"""Trace schema v2: the columns of the ``rounds`` and ``positions`` tables and their validation.

Version 2 adds the draft's online signals to the positions table: ``ent_1..Kmax`` (entropy of the
draft's distribution at each drafted token, nats) and ``margin_1..Kmax`` (its top-1 minus top-2
probability). Version-1 sets (without them) still load: the columns are then optional, and a
reader that needs them says so in one line (:meth:`specenv.traces.traceset.PositionArrays.signals`). The
rounds table is the same in both versions.

Every check is vectorised and reports the *first* offending row as one line naming the file, the
column and the row (:class:`TraceError`). Nothing here reads or writes files; see
:mod:`specenv.traces.traceset` for I/O and the manifest.

The schema is documented for people in ``traces/README.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from specenv.validation import CAP_LEVELS_MAX, KMAX_MAX, TIME_MS_MAX, one_line

#: The version this specenv writes.
SCHEMA_VERSION = 2
#: The versions it reads.
SUPPORTED_SCHEMA_VERSIONS = (1, 2)

#: Required columns of the rounds table (one row per executed verification round).
ROUNDS_COLUMNS: dict[str, pa.DataType] = {
    "generation_id": pa.int64(),
    "category": pa.string(),
    "round": pa.int32(),
    "K": pa.int32(),
    "m": pa.int32(),
    "accepted": pa.int32(),
    "L": pa.int32(),
    "U_r": pa.float32(),
    "E_max": pa.float32(),
    "T_T_ms": pa.float32(),
    "T_D_ms": pa.float32(),
}

#: Optional column of the rounds table: the verification-time expert cap B the round ran with (0 = none;
#: k = 0 rounds are never capped, whatever it says). The round's ``U_r`` is then the capped one.
ROUNDS_CAP_COLUMN = "cap"

#: Fixed (non-indexed) columns of the positions table; rho_j, q_j, U_j (and from v2 ent_j, margin_j) follow.
POSITIONS_FIXED: dict[str, pa.DataType] = {
    "generation_id": pa.int64(),
    "category": pa.string(),
    "t": pa.int32(),
    "L": pa.int32(),
}


def _bounded(kmax: int) -> int:
    """``kmax`` if it is in 1..KMAX_MAX (checked before any list of column names is built)."""
    if isinstance(kmax, bool) or not isinstance(kmax, (int, np.integer)) or not 0 <= kmax <= KMAX_MAX:
        raise ValueError(f"kmax={kmax!r}: must be an integer in 1..{KMAX_MAX}")
    return int(kmax)


def rho_columns(kmax: int) -> list[str]:
    """Names of the conditional-acceptance columns rho_1..rho_kmax."""
    kmax = _bounded(kmax)
    return [f"rho_{j}" for j in range(1, kmax + 1)]


def q_columns(kmax: int) -> list[str]:
    """Names of the draft-confidence columns q_1..q_kmax."""
    kmax = _bounded(kmax)
    return [f"q_{j}" for j in range(1, kmax + 1)]


def u_columns(kmax: int) -> list[str]:
    """Names of the unique-expert columns U_0..U_kmax (U_0 is a single position: top_k)."""
    kmax = _bounded(kmax)
    return [f"U_{k}" for k in range(0, kmax + 1)]


def ent_columns(kmax: int) -> list[str]:
    """Names of the draft-entropy columns ent_1..ent_kmax (schema v2)."""
    kmax = _bounded(kmax)
    return [f"ent_{j}" for j in range(1, kmax + 1)]


def margin_columns(kmax: int) -> list[str]:
    """Names of the draft top-1/top-2 margin columns margin_1..margin_kmax (schema v2)."""
    kmax = _bounded(kmax)
    return [f"margin_{j}" for j in range(1, kmax + 1)]


def signal_columns(kmax: int) -> list[str]:
    """The schema-v2 signal columns: ent_1..kmax then margin_1..kmax."""
    return ent_columns(kmax) + margin_columns(kmax)


def positions_columns(kmax: int, signals: bool = True, n_caps: int = 0) -> dict[str, pa.DataType]:
    """The columns of the positions table for a given Kmax, in canonical order.

    Args:
        kmax: Number of draft positions.
        signals: Include the schema-v2 signal columns (ent_j, margin_j); False gives the v1 columns.
        n_caps: Number of expert-cap levels of the ``caps-v1`` extension (0: none); their columns
            (:func:`cap_columns`) come last.
    """
    cols = dict(POSITIONS_FIXED)
    names = rho_columns(kmax) + q_columns(kmax) + u_columns(kmax)
    if signals:
        names += signal_columns(kmax)
    for name in names:
        cols[name] = pa.float32()
    if n_caps:
        cols.update(cap_columns(n_caps, kmax))
    return cols


#: The versioned schema extension of the expert-cap columns (manifest ``extensions``, traces/README.md).
CAPS_EXTENSION = "caps-v1"
#: The per-(cap level, k) quantities of the caps extension, in column order.
CAP_QUANTITIES = ("acc", "U", "mis", "lpgap")


def cap_column(quantity: str, level: int, k: int) -> str:
    """Name of one caps-extension column: ``{quantity}_c{level}_k{k}`` (level 1..C, k 1..Kmax)."""
    if quantity not in CAP_QUANTITIES:
        raise ValueError(f"quantity={quantity!r}: expected one of {CAP_QUANTITIES}")
    return f"{quantity}_c{int(level)}_k{int(k)}"


def cap_columns(n_caps: int, kmax: int) -> dict[str, pa.DataType]:
    """The caps-extension columns of the positions table (level-major, then k, then quantity) and their types.

    ``acc_c{c}_k{k}`` and ``mis_c{c}_k{k}`` are int32 (readers also take float32 holding integers),
    ``U_c{c}_k{k}`` and ``lpgap_c{c}_k{k}`` float32.
    """
    kmax = _bounded(kmax)
    if isinstance(n_caps, bool) or not isinstance(n_caps, (int, np.integer)) or not 0 <= n_caps <= CAP_LEVELS_MAX:
        raise ValueError(f"n_caps={n_caps!r}: must be an integer in 0..{CAP_LEVELS_MAX}")
    cols: dict[str, pa.DataType] = {}
    for c in range(1, int(n_caps) + 1):
        for k in range(1, kmax + 1):
            for q in CAP_QUANTITIES:
                cols[cap_column(q, c, k)] = pa.int32() if q in ("acc", "mis") else pa.float32()
    return cols


def has_signals(column_names: list[str] | set[str], kmax: int) -> bool:
    """Whether a positions table carries any schema-v2 signal column (ent_j or margin_j) for j <= kmax."""
    names = set(column_names)
    return any(c in names for c in signal_columns(kmax))


class TraceError(ValueError):
    """A trace file that breaks the schema. ``str(err)`` is one line: file, column, row, problem."""

    def __init__(self, file: str, problem: str, column: str | None = None, row: int | None = None):
        self.file = file
        self.column = column
        self.row = row
        self.problem = problem
        where = [file]
        if column is not None:
            where.append(f"column '{column}'")
        if row is not None:
            where.append(f"row {row}")
        super().__init__(one_line(": ".join([", ".join(where), problem])))


@dataclass(frozen=True)
class ModelFacts:
    """What the trace needs to know about the target model's MoE routing."""

    n_layers: int
    n_experts: int
    top_k: int


def _first(mask: np.ndarray) -> int | None:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def _check_columns(table: pa.Table, required: dict[str, pa.DataType], file: str) -> None:
    names = set(table.column_names)
    for col, typ in required.items():
        if col not in names:
            raise TraceError(file, "missing required column", column=col)
        actual = table.schema.field(col).type
        if pa.types.is_dictionary(actual):
            actual = actual.value_type
        ok = (
            (pa.types.is_integer(typ) and pa.types.is_integer(actual))
            or (pa.types.is_floating(typ) and (pa.types.is_floating(actual) or pa.types.is_integer(actual)))
            or (pa.types.is_string(typ) and (pa.types.is_string(actual) or pa.types.is_large_string(actual)))
        )
        if not ok:
            raise TraceError(file, f"has type {actual}, expected {typ}", column=col)
        if table.column(col).null_count:
            row = _first(np.asarray(table.column(col).is_null()))
            raise TraceError(file, "null value", column=col, row=row)


def _primitive(arr: pa.Array) -> np.ndarray:
    """The values of a numeric Arrow array as a read-only numpy view of its data buffer (nulls unmasked)."""
    typ = arr.type
    if pa.types.is_floating(typ):
        kind = "f"
    elif pa.types.is_signed_integer(typ):
        kind = "i"
    elif pa.types.is_unsigned_integer(typ):
        kind = "u"
    else:
        raise TypeError(f"not a numeric Arrow type: {typ}")
    dtype = np.dtype(f"{kind}{typ.bit_width // 8}")
    if len(arr) == 0:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=arr.offset + len(arr))[arr.offset :]


def column_values(table: pa.Table, col: str, dtype: type | np.dtype) -> np.ndarray:
    """A numeric column as a numpy array of ``dtype``, read from the Arrow buffers.

    Equal to ``table.column(col).to_numpy().astype(dtype)`` but without pyarrow's pandas-based
    conversion (``to_numpy`` imports pandas, ~0.7 s). The column must be integer or floating point;
    null slots are not masked (validation rejects nulls first). The result may be a read-only view.
    """
    chunks = table.column(col).chunks
    parts = [_primitive(c) for c in chunks]
    out = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0)
    return out.astype(dtype, copy=False)


def column_strings(table: pa.Table, col: str) -> np.ndarray:
    """A string (or dictionary-encoded string) column as a numpy object array of ``str``, without pandas."""
    parts = []
    for chunk in table.column(col).chunks:
        if pa.types.is_dictionary(chunk.type):
            values = np.empty(len(chunk.dictionary), dtype=object)
            values[:] = chunk.dictionary.to_pylist()
            parts.append(values[_primitive(chunk.indices)])
        else:
            values = np.empty(len(chunk), dtype=object)
            values[:] = chunk.to_pylist()
            parts.append(values)
    if not parts:
        return np.empty(0, dtype=object)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _num(table: pa.Table, col: str, dtype: type) -> np.ndarray:
    return column_values(table, col, dtype)


def _require(mask_bad: np.ndarray, file: str, column: str, problem: str) -> None:
    row = _first(mask_bad)
    if row is not None:
        raise TraceError(file, problem, column=column, row=row)


def _finite(arr: np.ndarray, file: str, column: str) -> None:
    _require(~np.isfinite(arr), file, column, "NaN or infinite value")


def validate_rounds(table: pa.Table, facts: ModelFacts, kmax: int, file: str = "rounds.parquet") -> None:
    """Validate a rounds table against schema v1 (with the optional ``cap`` column: 0..n_experts, U_r <= cap).

    Args:
        table: The table as read from Parquet.
        facts: Routing facts of the target model (from the manifest).
        kmax: Largest budget K allowed (from the manifest).
        file: Name used in error messages.

    Raises:
        TraceError: On the first violation, naming file, column and row.
    """
    if table.num_rows == 0:
        raise TraceError(file, "table has no rows")
    _check_columns(table, ROUNDS_COLUMNS, file)
    K = _num(table, "K", np.int64)
    m = _num(table, "m", np.int64)
    acc = _num(table, "accepted", np.int64)
    _require((K < 0) | (K > kmax), file, "K", f"budget outside 0..{kmax}")
    _require((m < 1) | (m > K + 1), file, "m", "verified positions must satisfy 1 <= m <= K+1")
    _require(acc < 0, file, "accepted", "negative accepted count")
    _require(acc > K, file, "accepted", "accepted > K")
    _require(acc > m - 1, file, "accepted", "accepted > m-1")
    L = _num(table, "L", np.int64)
    _require(L < 1, file, "L", "context length must be >= 1")
    rnd = _num(table, "round", np.int64)
    _require(rnd < 0, file, "round", "negative round index")
    for col in ("U_r", "E_max", "T_T_ms", "T_D_ms"):
        _finite(_num(table, col, np.float64), file, col)
    U = _num(table, "U_r", np.float64)
    eps = 1e-4
    _require(U < facts.top_k - eps, file, "U_r", f"below top_k={facts.top_k}")
    _require(U > facts.n_experts + eps, file, "U_r", f"above n_experts={facts.n_experts}")
    _require(U > m * facts.top_k + eps, file, "U_r", "above m*top_k (more experts than routed slots)")
    E = _num(table, "E_max", np.float64)
    _require((E < 1 - eps) | (E > m + eps), file, "E_max", "must lie in [1, m]")
    _require(_num(table, "T_T_ms", np.float64) <= 0, file, "T_T_ms", "target time must be > 0")
    _require(_num(table, "T_D_ms", np.float64) < 0, file, "T_D_ms", "draft time must be >= 0")
    for col in ("T_T_ms", "T_D_ms"):
        _require(
            _num(table, col, np.float64) > TIME_MS_MAX,
            file,
            col,
            f"above {TIME_MS_MAX:g} ms (not a plausible round time)",
        )
    gid = _num(table, "generation_id", np.int64)
    _require(gid < 0, file, "generation_id", "negative generation id")
    _, first, inverse = np.unique(gid, return_index=True, return_inverse=True)
    cats = column_strings(table, "category")
    _require(cats != cats[first][inverse], file, "category", "category changes inside a generation")
    if ROUNDS_CAP_COLUMN in table.column_names:
        _check_columns(table, {ROUNDS_CAP_COLUMN: pa.int32()}, file)
        cap = _num(table, ROUNDS_CAP_COLUMN, np.int64)
        _require(
            (cap < 0) | (cap > facts.n_experts), file, ROUNDS_CAP_COLUMN, f"cap outside 0..{facts.n_experts} (0 = none)"
        )
        _require(
            (cap > 0) & (K >= 1) & (U > cap + eps),
            file,
            "U_r",
            f"above the round's expert cap (column '{ROUNDS_CAP_COLUMN}')",
        )


def _beyond_kmax(table: pa.Table, kmax: int, file: str, n_caps: int = 0) -> None:
    """Refuse indexed columns past ``kmax`` (a manifest kmax lower than the table would drop them silently).

    Caps-extension columns must have a level in 1..``n_caps`` (the manifest's ``caps``) and k in 1..kmax.
    """
    for name in table.column_names:
        hit = re.fullmatch(r"(rho|q|U|ent|margin)_(\d+)", name)
        if hit and int(hit.group(2)) > kmax:
            raise TraceError(file, f"column beyond the manifest's kmax={kmax}", column=name)
        hit = re.fullmatch(r"(acc|U|mis|lpgap)_c(\d+)_k(\d+)", name)
        if hit:
            c, k = int(hit.group(2)), int(hit.group(3))
            if not n_caps:
                raise TraceError(
                    file, "expert-cap column, but the manifest declares no caps (extension caps-v1)", column=name
                )
            if not 1 <= c <= n_caps:
                raise TraceError(file, f"cap level outside 1..{n_caps} (the manifest's caps)", column=name)
            if not 1 <= k <= kmax:
                raise TraceError(file, f"budget outside 1..{kmax} (k = 0 rounds are never capped)", column=name)


def generation_categories(table: pa.Table) -> dict[int, str]:
    """Generation id -> category of a validated table (one category per generation)."""
    gid = _num(table, "generation_id", np.int64)
    _, first = np.unique(gid, return_index=True)
    cats = column_strings(table, "category")
    return {int(gid[i]): str(cats[i]) for i in first}


def validate_pair(positions: pa.Table, rounds: pa.Table, positions_file: str, rounds_file: str) -> None:
    """The two tables of one set describe the same generations, with the same category each.

    Raises:
        TraceError: Naming both files and the first generation that differs.
    """
    p, r = generation_categories(positions), generation_categories(rounds)
    if p.keys() != r.keys():
        only_p, only_r = sorted(p.keys() - r.keys()), sorted(r.keys() - p.keys())
        g, where = (only_p[0], "positions only") if only_p else (only_r[0], "rounds only")
        raise TraceError(
            rounds_file,
            f"generation ids differ from {positions_file} ({len(only_p)} in positions only, "
            f"{len(only_r)} in rounds only; first: {g}, {where})",
            column="generation_id",
        )
    for g in sorted(p):
        if p[g] != r[g]:
            raise TraceError(
                rounds_file,
                f"generation {g} has category {r[g]!r} here and {p[g]!r} in {positions_file}",
                column="category",
            )


def validate_positions(
    table: pa.Table,
    facts: ModelFacts,
    kmax: int,
    greedy: bool,
    file: str = "positions.parquet",
    schema_version: int = SCHEMA_VERSION,
    vocab_size: int | None = None,
    caps: list[int] | tuple[int, ...] | None = None,
) -> None:
    """Validate a positions table against schema v1 or v2 (and the ``caps-v1`` extension when ``caps``).

    Checks types, NaN, 0<=rho<=1 (and rho in {0,1} for greedy traces), 0<=q<=1, U_0 == top_k,
    U non-decreasing in k, each extra position adding at most top_k experts, U <= n_experts,
    positions t = 0..N-1 contiguous per generation with L_t = L_0 + t. The signal columns (required
    from v2; in a v1 table all of them or none) are checked by :func:`_check_signals`.

    Args:
        table: The table as read from Parquet.
        facts: Routing facts of the target model.
        kmax: Number of draft positions the table carries.
        greedy: Whether the trace was recorded with greedy decoding (rho must be 0 or 1).
        file: Name used in error messages.
        schema_version: The set's schema version (from its manifest).
        vocab_size: The draft's vocabulary size, when known (bounds the entropy by its log).
        caps: The manifest's expert caps B_1 < ... < B_C (extension ``caps-v1``; None: no cap
            columns allowed); their columns are checked by :func:`validate_caps`.

    Raises:
        TraceError: On the first violation, naming file, column and row.
    """
    if table.num_rows == 0:
        raise TraceError(file, "table has no rows")
    signals = schema_version >= 2 or has_signals(table.column_names, kmax)
    _check_columns(table, positions_columns(kmax, signals=signals), file)
    _beyond_kmax(table, kmax, file, n_caps=len(caps) if caps else 0)
    gid = _num(table, "generation_id", np.int64)
    _require(gid < 0, file, "generation_id", "negative generation id")
    t = _num(table, "t", np.int64)
    L = _num(table, "L", np.int64)
    new_gen = np.ones(len(gid), dtype=bool)
    new_gen[1:] = gid[1:] != gid[:-1]
    # contiguity: each generation is one block, t runs 0..N-1
    starts = np.flatnonzero(new_gen)
    _, first_idx = np.unique(gid, return_index=True)
    if len(first_idx) != len(starts):
        seen = set()
        for s in starts:
            g = int(gid[s])
            if g in seen:
                raise TraceError(
                    file, f"generation {g} is not one contiguous block", column="generation_id", row=int(s)
                )
            seen.add(g)
    expected_t = np.arange(len(t)) - np.repeat(starts, np.diff(np.append(starts, len(t))))
    _require(t != expected_t, file, "t", "positions not contiguous from 0 within the generation")
    L0 = np.repeat(L[starts], np.diff(np.append(starts, len(t))))
    _require(L < 1, file, "L", "context length must be >= 1")
    _require(L != L0 + t, file, "L", "L_t must equal L_0 + t")
    cats = column_strings(table, "category")
    changed = np.zeros(len(cats), dtype=bool)
    changed[1:] = (~new_gen[1:]) & (cats[1:] != cats[:-1])
    _require(changed, file, "category", "category changes inside a generation")
    eps = 1e-4
    for col in rho_columns(kmax):
        r = _num(table, col, np.float64)
        _finite(r, file, col)
        _require((r < 0) | (r > 1), file, col, "probability outside [0, 1]")
        if greedy:
            _require((r != 0) & (r != 1), file, col, "greedy trace needs rho in {0, 1}")
    for col in q_columns(kmax):
        q = _num(table, col, np.float64)
        _finite(q, file, col)
        _require((q < 0) | (q > 1), file, col, "probability outside [0, 1]")
    prev = None
    for k, col in enumerate(u_columns(kmax)):
        u = _num(table, col, np.float64)
        _finite(u, file, col)
        if k == 0:
            _require(np.abs(u - facts.top_k) > eps, file, col, f"U_0 must equal top_k={facts.top_k}")
        else:
            _require(u < prev - eps, file, col, "U decreasing in k")
            _require(u > prev + facts.top_k + eps, file, col, f"one more position adds more than top_k={facts.top_k}")
        _require(u > facts.n_experts + eps, file, col, f"above n_experts={facts.n_experts}")
        prev = u
    if signals:
        _check_signals(table, kmax, file, vocab_size)
    if caps:
        validate_caps(table, facts, kmax, caps, file)


def _integral(arr: np.ndarray, file: str, column: str) -> None:
    _require(arr != np.round(arr), file, column, "must be a whole number")


def validate_caps(
    table: pa.Table, facts: ModelFacts, kmax: int, caps: list[int] | tuple[int, ...], file: str = "positions.parquet"
) -> None:
    """Validate the ``caps-v1`` columns of a positions table (traces/README.md, "Expert caps").

    For every cap level c (cap B_c) and budget k = 1..kmax: ``acc`` a whole number in 0..k; ``mis`` a
    whole number in 0..acc+1 (it counts committed tokens, at most acc + 1); ``U`` finite, at least
    min(top_k, B_c), at most B_c (the cap bounds every layer's union, hence their mean), n_experts and
    (k+1)*top_k; ``lpgap`` finite. ``lpgap`` has no sign constraint: the capped target may give the
    uncapped argmax a *higher* log-probability than the uncapped target does (it is 0 exactly where
    the cap binds in no layer).

    Args:
        table: The positions table.
        facts: Routing facts of the target model.
        kmax: Largest budget.
        caps: The caps B_1 < ... < B_C, each in 1..n_experts-1.
        file: Name used in error messages.

    Raises:
        TraceError: On the first violation, naming file, column and row.
    """
    caps = [int(b) for b in caps]
    if any(b < 1 or b >= facts.n_experts for b in caps) or any(
        b >= a for a, b in zip(caps[1:], caps[:-1], strict=False)
    ):
        raise TraceError(file, f"caps {caps}: must be strictly ascending, each in 1..n_experts-1={facts.n_experts - 1}")
    # the counts may be stored as int32 or float32 holding whole numbers (checked below)
    _check_columns(table, dict.fromkeys(cap_columns(len(caps), kmax), pa.float32()), file)
    eps = 1e-4
    for c, B in enumerate(caps, start=1):
        for k in range(1, kmax + 1):
            col = cap_column("acc", c, k)
            acc = _num(table, col, np.float64)
            _finite(acc, file, col)
            _integral(acc, file, col)
            _require((acc < 0) | (acc > k), file, col, f"accepted drafts outside 0..{k}")
            col = cap_column("mis", c, k)
            mis = _num(table, col, np.float64)
            _finite(mis, file, col)
            _integral(mis, file, col)
            _require(mis < 0, file, col, "negative mismatch count")
            _require(mis > acc + 1, file, col, f"more mismatches than committed tokens ({cap_column('acc', c, k)} + 1)")
            col = cap_column("U", c, k)
            u = _num(table, col, np.float64)
            _finite(u, file, col)
            low = min(facts.top_k, B)
            _require(u < low - eps, file, col, f"below min(top_k, cap) = {low}")
            _require(u > B + eps, file, col, f"above the cap B={B}")
            _require(u > facts.n_experts + eps, file, col, f"above n_experts={facts.n_experts}")
            _require(u > (k + 1) * facts.top_k + eps, file, col, "above (k+1)*top_k (more experts than routed slots)")
            col = cap_column("lpgap", c, k)
            _finite(_num(table, col, np.float64), file, col)


#: Tolerance of the signal checks (the generator stores them as multiples of 1/1024, engines in float32).
SIGNAL_EPS = 1e-3


def binary_entropy(q: np.ndarray) -> np.ndarray:
    """h(q) = -q log q - (1-q) log(1-q) in nats (0 at q in {0, 1}).

    The least entropy of any distribution that gives one token the probability q.
    """
    q = np.clip(np.asarray(q, dtype=np.float64), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = -np.where(q > 0, q * np.log(q), 0.0) - np.where(q < 1, (1 - q) * np.log1p(-q), 0.0)
    return out


def _check_signals(table: pa.Table, kmax: int, file: str, vocab_size: int | None) -> None:
    """Check the schema-v2 columns, to :data:`SIGNAL_EPS`.

    ent_j: finite, >= 0, <= log(vocab) (when known) and >= h(q_j) (a token of probability q forces
    that much entropy). margin_j: finite, in [0, 1] and >= 2 q_j - 1 (top-1 >= q_j, top-2 <= 1 - top-1).
    """
    eps = SIGNAL_EPS
    cap = float(np.log(vocab_size)) if vocab_size else None
    for j, (ecol, mcol, qcol) in enumerate(zip(ent_columns(kmax), margin_columns(kmax), q_columns(kmax), strict=True)):
        q = _num(table, qcol, np.float64)
        ent = _num(table, ecol, np.float64)
        _finite(ent, file, ecol)
        _require(ent < 0, file, ecol, "negative entropy")
        if cap is not None:
            _require(ent > cap + eps, file, ecol, f"entropy above log(vocab_size={vocab_size}) = {cap:.4f} nats")
        _require(
            ent < binary_entropy(q) - eps,
            file,
            ecol,
            f"entropy below h(q_{j + 1}), the least a token of probability q allows",
        )
        mar = _num(table, mcol, np.float64)
        _finite(mar, file, mcol)
        _require((mar < 0) | (mar > 1), file, mcol, "margin outside [0, 1]")
        _require(mar < 2 * q - 1 - eps, file, mcol, f"margin below 2*q_{j + 1} - 1 (top-1 >= q, top-2 <= 1 - top-1)")
