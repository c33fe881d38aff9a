"""Trace sets on disk: a folder with ``manifest.json`` plus Parquet tables, validated on load.

Layout of a trace set folder::

    manifest.json        schema version, source/profile, model facts, Kmax, counts, sha256 per file
    positions.parquet    counterfactual table (env and oracle run on it)      [optional]
    rounds.parquet       executed verification rounds (cost model fits on it) [optional]

At least one of the two tables must be present. Writing is atomic: files go to a temporary sibling
folder that is renamed into place once the manifest (written last) is complete, so a crash never
leaves a folder that loads as valid. No pickle anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from specenv.io import (
    NotRegularFile,
    ReplaceRefused,
    atomic_dir,
    atomic_write_json,
    check_new_path,
    check_regular,
    check_replaceable,
    not_regular,
    sha256_file,
)
from specenv.traces.schema import (
    CAPS_EXTENSION,
    ROUNDS_COLUMNS,
    SCHEMA_VERSION,
    SUPPORTED_SCHEMA_VERSIONS,
    ModelFacts,
    TraceError,
    cap_column,
    column_strings,
    column_values,
    ent_columns,
    has_signals,
    margin_columns,
    positions_columns,
    q_columns,
    rho_columns,
    u_columns,
    validate_pair,
    validate_positions,
    validate_rounds,
)

if TYPE_CHECKING:  # pandas is imported only where a DataFrame is really needed (it costs ~0.7 s)
    import pandas as pd

__all__ = ["MANIFEST", "TABLES", "CapArrays", "Manifest", "PositionArrays", "TraceSet", "sha256_file"]

MANIFEST = "manifest.json"
TABLES = ("positions", "rounds")


@dataclass
class Manifest:
    """The JSON manifest of a trace set.

    Attributes:
        name: Short name of the set (e.g. ``paper-default``).
        source: Where the traces come from: ``generator``, ``hf`` (live CPU engine) or ``vllm``.
        profile: Generator profile or engine description.
        model: Routing facts of the target model.
        kmax: Largest draft budget the tables cover.
        greedy: True when decoding was greedy (rho in {0, 1}).
        counts: Row counts: ``generations``, ``positions``, ``rounds``.
        files: Per table: ``path``, ``sha256``, ``rows``.
        version: Version of this named set.
        description: One paragraph for people.
        max_new_tokens: Generation cap used when recording (observation scaling uses it).
        extra: Free-form provenance (generator seed and parameters, engine settings...).
        schema_version: Trace schema version, one of :data:`specenv.traces.schema.SUPPORTED_SCHEMA_VERSIONS`
            (:meth:`TraceSet.save` writes 2 when the positions carry the signal columns or the set has
            no positions, else 1).
        vocab_size: The draft's vocabulary size, when known (the entropy columns are <= its log).
        caps: The expert caps B_1 < ... < B_C of the ``caps-v1`` extension (each < n_experts; cap
            level 0, uncapped, is implicit), or None for a set without cap columns.
        extensions: Versioned schema extensions the set uses (``["caps-v1"]`` when ``caps``);
            :meth:`TraceSet.save` sets it from ``caps``.
    """

    name: str
    source: str
    profile: str
    model: ModelFacts
    kmax: int
    greedy: bool
    counts: dict[str, int] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: int = 1
    description: str = ""
    max_new_tokens: int = 1000
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    vocab_size: int | None = None
    caps: list[int] | None = None
    extensions: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form, as written to ``manifest.json``."""
        return {
            "format": "specenv.traces",
            "schema_version": self.schema_version,
            "name": self.name,
            "version": self.version,
            "description": self.description,
            "source": self.source,
            "profile": self.profile,
            "greedy": self.greedy,
            "model": {
                "n_layers": self.model.n_layers,
                "n_experts": self.model.n_experts,
                "top_k": self.model.top_k,
            },
            "kmax": self.kmax,
            "max_new_tokens": self.max_new_tokens,
            **({"vocab_size": self.vocab_size} if self.vocab_size is not None else {}),
            **({"caps": [int(b) for b in self.caps]} if self.caps is not None else {}),
            **({"extensions": list(self.extensions)} if self.extensions else {}),
            "counts": self.counts,
            "files": self.files,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, obj: Any, file: str = MANIFEST) -> Manifest:
        """Parse and check a manifest object (:class:`specenv.validation` ``ManifestJSON``: strict types, bounds).

        Raises:
            TraceError: One line naming the file and the field: missing, mistyped, out of range
                (kmax 1..64, 1 <= top_k <= n_experts <= 4096, n_layers 1..1024, max_new_tokens >= 1,
                counts >= 0), a name with control characters, an unsupported schema version, an
                unknown extension, or ``caps`` that are not 1..16 strictly ascending ints below
                n_experts (``caps`` and the extension ``caps-v1`` go together).
        """
        from specenv.validation import check

        if isinstance(obj, dict):
            version = obj.get("schema_version")
            if isinstance(version, int) and not isinstance(version, bool) and version not in SUPPORTED_SCHEMA_VERSIONS:
                known = ", ".join(map(str, SUPPORTED_SCHEMA_VERSIONS))
                raise TraceError(file, f"unsupported schema_version {version} (this specenv reads {known})")
        m = check("ManifestJSON", obj, file, error=TraceError)
        return cls(
            name=m.name,
            source=m.source,
            profile=m.profile,
            model=ModelFacts(m.model.n_layers, m.model.n_experts, m.model.top_k),
            kmax=m.kmax,
            greedy=m.greedy,
            counts=dict(obj.get("counts", {})),
            files={tab: dict(ent) for tab, ent in obj["files"].items()},
            version=m.version,
            description=m.description,
            max_new_tokens=m.max_new_tokens,
            extra=dict(m.extra),
            schema_version=m.schema_version,
            vocab_size=m.vocab_size,
            caps=None if m.caps is None else list(m.caps),
            extensions=list(m.extensions),
        )


def survival_table(rho: np.ndarray, axis: int = -1, out: np.ndarray | None = None) -> np.ndarray:
    """Acceptance survival ``P(a >= i) = prod_{j<=i} rho_j``: the cumulative product along ``axis``.

    The one implementation of the survival table: the environments, the oracle (on its step-ordered
    tables, ``axis=0``) and the benchmark priors all use it, usually through
    :meth:`PositionArrays.survival`. rho is clipped to [0, 1] first (validated tables already are,
    so this changes nothing on them).

    Args:
        rho: Conditional acceptance probabilities, depth j along ``axis``.
        axis: The depth axis.
        out: Where to write (may be ``rho`` itself, for in-place use); default a new array.

    Returns:
        The survival probabilities, same shape as ``rho``.
    """
    out = np.clip(rho, 0.0, 1.0, out=out)
    if out.ndim == 1:  # one row (a policy's online estimates): the same products, in one call
        return np.multiply.accumulate(out, out=out)
    by_depth = np.moveaxis(out, axis, 0)  # a view: depth-by-depth products run over whole slices
    for j in range(1, by_depth.shape[0]):
        by_depth[j] *= by_depth[j - 1]
    return out


def expected_accepted_table(rho: np.ndarray) -> np.ndarray:
    """``E[a(k)] = sum_{i<=k} P(a >= i)`` for k = 0..K from conditional acceptances ``rho`` (depth last).

    Args:
        rho: ``(..., K)`` conditional acceptance probabilities (a trace's rho or online estimates).

    Returns:
        ``(..., K + 1)``; entry 0 is 0 (a plain AR step accepts nothing).
    """
    S = survival_table(np.asarray(rho, dtype=np.float64))
    out = np.empty((*S.shape[:-1], S.shape[-1] + 1))
    out[..., 0] = 0.0
    np.cumsum(S, axis=-1, out=out[..., 1:])
    return out


@dataclass(frozen=True)
class CapArrays:
    """The ``caps-v1`` columns of a positions table, packed (traces/README.md, "Expert caps").

    For cap level c (0-based here; column level c+1, cap ``caps[c]`` experts per MoE layer), budget
    k and position row i, the capped target verifies the same draft chain as the uncapped one, with
    the cap applied over the k+1 verified positions. Index k = 0 is filled with the uncapped round
    (k = 0 is never capped): acc 0, U = top_k (the positions' ``U_0``), mis 0, lpgap 0.

    Attributes:
        caps: (C,) int64 the caps B_1 < ... < B_C (experts per layer).
        acc: (C, kmax+1, n) int64 drafts the capped target accepts (0..k).
        U: (C, kmax+1, n) float64 capped unique experts (mean over layers of the capped union, <= B_c).
        mis: (C, kmax+1, n) int64 committed tokens of that round (the acc + 1 tokens, those within the
            reference output) that differ from the uncapped greedy reference at the same positions.
        lpgap: (C, kmax+1, n) float64 mean over the k+1 verified positions of the uncapped
            log-probability of the uncapped argmax minus the capped log-probability of that token.
    """

    caps: np.ndarray
    acc: np.ndarray
    U: np.ndarray
    mis: np.ndarray
    lpgap: np.ndarray

    @property
    def n_levels(self) -> int:
        """Number of cap levels C (the uncapped level is not counted)."""
        return int(len(self.caps))

    @property
    def kmax(self) -> int:
        """Largest budget carried."""
        return int(self.acc.shape[1] - 1)

    def rows(self, index: np.ndarray) -> CapArrays:
        """The same levels and budgets for the position rows ``index`` (in that order)."""
        return CapArrays(
            self.caps, self.acc[..., index], self.U[..., index], self.mis[..., index], self.lpgap[..., index]
        )

    def with_kmax(self, kmax: int) -> CapArrays:
        """Budgets 0..kmax only."""
        sl = slice(0, kmax + 1)
        return CapArrays(self.caps, self.acc[:, sl], self.U[:, sl], self.mis[:, sl], self.lpgap[:, sl])

    @classmethod
    def from_columns(cls, get: Any, caps: list[int], kmax: int, U0: np.ndarray) -> CapArrays:
        """Pack from a column getter ``get(name) -> (n,) array`` (Arrow table or DataFrame).

        Args:
            get: Returns one column as a numpy array.
            caps: The manifest's caps.
            kmax: Largest budget.
            U0: (n,) the positions' ``U_0`` (top_k), the k = 0 entry of ``U``.
        """
        C, n = len(caps), len(U0)
        acc = np.zeros((C, kmax + 1, n), dtype=np.int64)
        mis = np.zeros((C, kmax + 1, n), dtype=np.int64)
        U = np.empty((C, kmax + 1, n), dtype=np.float64)
        lp = np.zeros((C, kmax + 1, n), dtype=np.float64)
        U[:, 0] = U0
        for c in range(C):
            for k in range(1, kmax + 1):
                acc[c, k] = np.rint(get(cap_column("acc", c + 1, k)))
                mis[c, k] = np.rint(get(cap_column("mis", c + 1, k)))
                U[c, k] = get(cap_column("U", c + 1, k))
                lp[c, k] = get(cap_column("lpgap", c + 1, k))
        for a in (acc, mis, U, lp):
            a.flags.writeable = False
        return cls(np.asarray(caps, dtype=np.int64), acc, U, mis, lp)


@dataclass(frozen=True)
class PositionArrays:
    """The positions table packed into numpy arrays, sorted by generation then t.

    Row ``offsets[g] + t`` holds position t of generation g. This is the form the environments and
    the oracle consume; it is built once per trace set.

    Attributes:
        generation_ids: (G,) int64 generation ids.
        categories: (G,) object array of category names.
        offsets: (G+1,) int64 row offsets; generation g has ``offsets[g+1]-offsets[g]`` positions.
        L: (n,) float64 context length L_t.
        rho: (n, kmax) float64 conditional acceptance probabilities.
        q: (n, kmax) float64 draft confidences.
        U: (n, kmax+1) float64 unique experts of every chain prefix, U[:, 0] = top_k.
        greedy: Whether rho is 0/1.
        ent: (n, kmax) float64 entropy (nats) of the draft's distribution at each drafted token, or
            None for a schema-v1 set (see :meth:`signals`).
        margin: (n, kmax) float64 top-1 minus top-2 probability of that distribution, or None.
        caps: The expert-cap columns (:class:`CapArrays`, extension ``caps-v1``), or None for a set
            without them (see :meth:`cap_arrays`).
    """

    generation_ids: np.ndarray
    categories: np.ndarray
    offsets: np.ndarray
    L: np.ndarray
    rho: np.ndarray
    q: np.ndarray
    U: np.ndarray
    greedy: bool
    ent: np.ndarray | None = None
    margin: np.ndarray | None = None
    caps: CapArrays | None = None

    @property
    def kmax(self) -> int:
        """Number of draft positions carried."""
        return int(self.rho.shape[1])

    @property
    def n_generations(self) -> int:
        """Number of generations G."""
        return int(len(self.generation_ids))

    @property
    def lengths(self) -> np.ndarray:
        """(G,) number of positions N of each generation."""
        return np.diff(self.offsets)

    def select(self, index: np.ndarray | list[int]) -> PositionArrays:
        """A new PositionArrays holding only the generations at ``index`` (in that order)."""
        index = np.asarray(index, dtype=np.int64)
        lens = self.lengths[index]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        rows = (
            np.concatenate([np.arange(self.offsets[g], self.offsets[g + 1]) for g in index])
            if len(index)
            else np.zeros(0, dtype=np.int64)
        )
        return PositionArrays(
            generation_ids=self.generation_ids[index],
            categories=self.categories[index],
            offsets=offsets,
            L=self.L[rows],
            rho=self.rho[rows],
            q=self.q[rows],
            U=self.U[rows],
            greedy=self.greedy,
            ent=None if self.ent is None else self.ent[rows],
            margin=None if self.margin is None else self.margin[rows],
            caps=None if self.caps is None else self.caps.rows(rows),
        )

    @property
    def has_caps(self) -> bool:
        """Whether the expert-cap columns are present (extension ``caps-v1``)."""
        return self.caps is not None

    def cap_arrays(self, what: str = "this reader") -> CapArrays:
        """The expert-cap columns (:class:`CapArrays`).

        Args:
            what: Who needs them, named in the error.

        Raises:
            ValueError: One line, when the set has no cap columns.
        """
        if self.caps is None:
            raise ValueError(
                f"{what} needs the expert-cap columns (acc_c*_k*, U_c*_k*, mis_c*_k*, lpgap_c*_k*; trace extension "
                "caps-v1); this trace set has none: use a set collected with caps (e.g. live-cpu-caps)"
            )
        return self.caps

    def remaining(self) -> np.ndarray:
        """(n,) int64 tokens left to generate at each position row, N - t (at least 1)."""
        lens = self.lengths
        start = np.repeat(self.offsets[:-1], lens)
        return np.repeat(lens, lens) - (np.arange(int(self.offsets[-1])) - start)

    def cap_quality(self) -> dict[str, np.ndarray]:
        """The quality cost of each cap level at each budget, over every position row.

        A round at (c, k) from position t commits ``min(acc + 1, N - t)`` tokens, ``mis`` of which
        differ from the reference. The rates are pooled ratios (sum of mismatches over sum of committed
        tokens), each position weighted once, as if every position started a round.

        Returns:
            ``mismatch_rate`` (C, kmax+1): mismatched / committed tokens; ``lpgap`` (C, kmax+1): mean
            log-prob gap; ``U`` (C, kmax+1): mean capped U; ``committed`` (C, kmax+1): committed
            tokens counted. Index k = 0 is the uncapped AR round (rate 0).

        Raises:
            ValueError: If the set has no cap columns.
        """
        ca = self.cap_arrays("cap_quality")
        committed = np.minimum(ca.acc + 1, self.remaining()[None, None, :])
        tot = committed.sum(axis=2)
        return {
            "mismatch_rate": ca.mis.sum(axis=2) / np.maximum(tot, 1),
            "lpgap": ca.lpgap.mean(axis=2),
            "U": ca.U.mean(axis=2),
            "committed": tot,
        }

    @property
    def has_signals(self) -> bool:
        """Whether the draft's entropy and margin are present (schema v2)."""
        return self.ent is not None and self.margin is not None

    def signals(self, what: str = "this reader") -> tuple[np.ndarray, np.ndarray]:
        """The draft's entropy and top-1/top-2 margin, ``(ent, margin)``, each (n, kmax).

        Args:
            what: Who needs them, named in the error.

        Raises:
            ValueError: One line, when the set has no signal columns (a schema-v1 set).
        """
        if self.ent is None or self.margin is None:
            raise ValueError(
                f"{what} needs the draft's entropy and margin (columns ent_j, margin_j of trace schema v2); "
                "this trace set has none (schema v1): regenerate or re-collect it"
            )
        return self.ent, self.margin

    def survival(self) -> np.ndarray:
        """The acceptance survival table ``S[t, i-1] = P(a >= i | t) = prod_{j<=i} rho_{t,j}``, i = 1..kmax.

        See :func:`survival_table` (rho clipped to [0, 1]; validated tables already are).

        Returns:
            (n, kmax) float64 array, non-increasing along each row.
        """
        return survival_table(self.rho, axis=1)

    def with_kmax(self, kmax: int) -> PositionArrays:
        """The same positions restricted to budgets 0..kmax (kmax <= self.kmax)."""
        if not 1 <= kmax <= self.kmax:
            raise ValueError(f"kmax={kmax} outside 1..{self.kmax} (the trace's Kmax)")
        return PositionArrays(
            self.generation_ids,
            self.categories,
            self.offsets,
            self.L,
            self.rho[:, :kmax],
            self.q[:, :kmax],
            self.U[:, : kmax + 1],
            self.greedy,
            None if self.ent is None else self.ent[:, :kmax],
            None if self.margin is None else self.margin[:, :kmax],
            None if self.caps is None else self.caps.with_kmax(kmax),
        )

    @classmethod
    def from_table(cls, table: pa.Table, kmax: int, greedy: bool, caps: list[int] | None = None) -> PositionArrays:
        """Pack a (validated) positions Arrow table; the same arrays as :meth:`from_frame`, without pandas.

        The (n, kmax) blocks are Fortran-ordered and read-only, as pandas' ``DataFrame.to_numpy``
        returns them, so every downstream reduction sees the same memory layout. ``caps`` (the
        manifest's) packs the cap columns into :attr:`caps`.
        """
        gid = column_values(table, "generation_id", np.int64)
        starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
        offsets = np.append(starts, len(gid)).astype(np.int64)
        signals = has_signals(table.column_names, kmax)
        U = _float_block(table, u_columns(kmax))
        return cls(
            generation_ids=gid[starts],
            categories=column_strings(table, "category")[starts],
            offsets=offsets,
            L=column_values(table, "L", np.float64).copy(),
            rho=_float_block(table, rho_columns(kmax)),
            q=_float_block(table, q_columns(kmax)),
            U=U,
            greedy=greedy,
            ent=_float_block(table, ent_columns(kmax)) if signals else None,
            margin=_float_block(table, margin_columns(kmax)) if signals else None,
            caps=CapArrays.from_columns(lambda c: column_values(table, c, np.float64), caps, kmax, U[:, 0])
            if caps
            else None,
        )

    @classmethod
    def from_frame(cls, df: pd.DataFrame, kmax: int, greedy: bool, caps: list[int] | None = None) -> PositionArrays:
        """Pack a (validated) positions DataFrame (``caps``: the manifest's, packs the cap columns)."""
        gid = df["generation_id"].to_numpy(np.int64)
        starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
        offsets = np.append(starts, len(gid)).astype(np.int64)
        signals = has_signals(list(df.columns), kmax)
        U = df[u_columns(kmax)].to_numpy(np.float64)
        return cls(
            generation_ids=gid[starts],
            categories=df["category"].astype(str).to_numpy(object)[starts],
            offsets=offsets,
            L=df["L"].to_numpy(np.float64),
            rho=df[rho_columns(kmax)].to_numpy(np.float64),
            q=df[q_columns(kmax)].to_numpy(np.float64),
            U=U,
            greedy=greedy,
            ent=df[ent_columns(kmax)].to_numpy(np.float64) if signals else None,
            margin=df[margin_columns(kmax)].to_numpy(np.float64) if signals else None,
            caps=CapArrays.from_columns(lambda c: df[c].to_numpy(np.float64), caps, kmax, U[:, 0]) if caps else None,
        )


def _float_block(table: pa.Table, names: list[str]) -> np.ndarray:
    """Columns ``names`` as one read-only, Fortran-ordered (n, len(names)) float64 array."""
    out = np.empty((table.num_rows, len(names)), dtype=np.float64, order="F")
    for j, name in enumerate(names):
        out[:, j] = column_values(table, name, np.float64)
    out.flags.writeable = False
    return out


class TraceSet:
    """A validated trace set: manifest plus the tables it names.

    A loaded set keeps its tables as the Arrow tables read from Parquet; :attr:`positions` and
    :attr:`rounds` convert them to pandas on first access (pandas is imported only then), while
    :meth:`arrays` packs the positions straight from Arrow, so making an environment never loads
    pandas. In-memory sets are built from DataFrames (or Arrow tables). Treat a loaded set's tables
    as read-only: sets are shared through :func:`specenv.traces.datasets.load_dataset`'s cache.

    Attributes:
        manifest: The parsed manifest.
        positions: The positions table as a DataFrame, or None if the set has none.
        rounds: The rounds table as a DataFrame, or None if the set has none.
        root: The folder it was loaded from (None for in-memory sets).
    """

    def __init__(
        self,
        manifest: Manifest,
        positions: pd.DataFrame | pa.Table | None = None,
        rounds: pd.DataFrame | pa.Table | None = None,
        root: Path | None = None,
    ) -> None:
        self.manifest = manifest
        self.root = root
        self._tables: dict[str, pa.Table | None] = {}
        self._frames: dict[str, pd.DataFrame | None] = {}
        self._verified: dict[str, str] = {}
        self._arrays: PositionArrays | None = None
        self.positions = positions
        self.rounds = rounds

    def __repr__(self) -> str:
        return (
            f"TraceSet(name={self.manifest.name!r}, kmax={self.kmax}, positions={self.has_positions}, "
            f"rounds={self.has_rounds}, root={self.root!r})"
        )

    # ------------------------------------------------------------------ tables
    def _set(self, tab: str, value: pd.DataFrame | pa.Table | None) -> None:
        self._verified.pop(tab, None)
        if tab == "positions":
            self._arrays = None
        if value is None or isinstance(value, pa.Table):
            self._tables[tab], self._frames[tab] = value, None
        else:
            self._tables[tab], self._frames[tab] = None, value

    def _frame(self, tab: str) -> pd.DataFrame | None:
        if self._frames[tab] is None and self._tables[tab] is not None:
            self._frames[tab] = self._tables[tab].to_pandas()
        return self._frames[tab]

    @property
    def positions(self) -> pd.DataFrame | None:
        """The positions table as a DataFrame (converted from Arrow on first access), or None."""
        return self._frame("positions")

    @positions.setter
    def positions(self, value: pd.DataFrame | pa.Table | None) -> None:
        self._set("positions", value)

    @property
    def rounds(self) -> pd.DataFrame | None:
        """The rounds table as a DataFrame (converted from Arrow on first access), or None."""
        return self._frame("rounds")

    @rounds.setter
    def rounds(self, value: pd.DataFrame | pa.Table | None) -> None:
        self._set("rounds", value)

    @property
    def has_positions(self) -> bool:
        """Whether the set has a positions table (no pandas conversion)."""
        return self._tables["positions"] is not None or self._frames["positions"] is not None

    @property
    def has_rounds(self) -> bool:
        """Whether the set has a rounds table (no pandas conversion)."""
        return self._tables["rounds"] is not None or self._frames["rounds"] is not None

    def verified_sha256(self, tab: str) -> str | None:
        """sha256 of the file table ``tab`` was read from, when it was checked against the manifest on load.

        None for in-memory tables, sets loaded with ``verify_hashes=False`` and tables replaced
        after loading: content-keyed caches (the fitted cost model) use a set only when this is known.
        """
        return self._verified.get(tab)

    @property
    def facts(self) -> ModelFacts:
        """Routing facts of the target model."""
        return self.manifest.model

    @property
    def kmax(self) -> int:
        """Largest budget the tables cover."""
        return self.manifest.kmax

    def arrays(self) -> PositionArrays:
        """The positions table as packed numpy arrays (cached; built from Arrow without pandas when loaded).

        Raises:
            ValueError: If the set has no positions table.
        """
        if not self.has_positions:
            raise ValueError(f"trace set '{self.manifest.name}' has no positions table")
        if self._arrays is None:
            table = self._tables["positions"]
            if table is not None:
                self._arrays = PositionArrays.from_table(table, self.kmax, self.manifest.greedy, self.manifest.caps)
            else:
                self._arrays = PositionArrays.from_frame(
                    self._frames["positions"], self.kmax, self.manifest.greedy, self.manifest.caps
                )
        return self._arrays

    # ------------------------------------------------------------------ I/O
    @classmethod
    def load(cls, root: str | os.PathLike[str], verify_hashes: bool = True) -> TraceSet:
        """Load and validate a trace set folder.

        Tables whose sha256 matches the manifest and whose content checks passed before, under the same
        manifest and the same validation code (:func:`specenv.validation.passed_before`, in the disk
        cache), are not checked again; with ``verify_hashes=False`` every check runs.

        Args:
            root: Folder holding ``manifest.json``.
            verify_hashes: Check every file's sha256 against the manifest.

        Raises:
            TraceError: One line naming the file, column and first bad row.
        """
        from specenv.validation import passed_before, read_json, remember_pass

        root = Path(root)
        mpath = root / MANIFEST
        if not root.is_dir():
            raise TraceError(str(root), "not a trace set folder")
        if not mpath.is_file():  # absent, or a FIFO, device, folder or dangling link standing in for it
            why = not_regular(mpath)
            raise TraceError(str(mpath), "missing manifest" if why in (None, "does not exist") else f"manifest {why}")
        manifest = Manifest.from_json(read_json(mpath, TraceError, what="manifest"), str(mpath))
        # tables whose bytes match the manifest's sha256 and passed these checks before pass them again
        known, key = passed_before("trace tables", manifest.to_json()) if verify_hashes else (False, None)
        tables: dict[str, pa.Table | None] = {"positions": None, "rounds": None}
        verified: dict[str, str] = {}
        for tab, ent in manifest.files.items():
            path = root / ent["path"]
            tables[tab] = _load_table(tab, path, ent, manifest, verified if verify_hashes else None, not known)
        _check_counts(manifest, tables, str(mpath))
        if not known and tables["positions"] is not None and tables["rounds"] is not None:
            validate_pair(
                tables["positions"],
                tables["rounds"],
                str(root / manifest.files["positions"]["path"]),
                str(root / manifest.files["rounds"]["path"]),
            )
        if not known:
            remember_pass(key)
        ts = cls(manifest, tables["positions"], tables["rounds"], root=root)
        ts._verified.update(verified)
        return ts

    def save(self, root: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Validate and write the set atomically; fills in counts, rows and sha256 in the manifest.

        The manifest's ``schema_version`` is set from the tables: 2 (:data:`SCHEMA_VERSION`), or 1
        when the positions table has no signal columns (ent_j, margin_j); a v1 table keeps loading
        as what it is.

        Args:
            root: Destination folder (created with its missing parents; must not exist unless
                ``overwrite``).
            overwrite: Replace an existing folder, which must be a trace set (see
                :func:`check_save_destination`). The new set is written beside it and the two are
                exchanged in one step (:func:`specenv.io.atomic_dir`), then the old one is removed.

        Returns:
            The destination path.

        Raises:
            FileExistsError: ``root`` exists and ``overwrite`` is false.
            specenv.io.ReplaceRefused: ``root`` exists but is not a trace set, or is a folder that
                is never replaced (the working directory, a folder above it, home, the root).
            OSError: Nothing can be created at ``root``.
        """
        root = Path(root)
        check_save_destination(root, overwrite)
        with atomic_dir(root, replace=overwrite) as tmp:
            m = self.manifest
            files: dict[str, dict[str, Any]] = {}
            m.schema_version = SCHEMA_VERSION
            m.extensions = [e for e in m.extensions if e != CAPS_EXTENSION]
            if m.caps is not None:
                m.caps = [int(b) for b in m.caps]
                m.extensions.append(CAPS_EXTENSION)
            if self.positions is not None:
                signals = has_signals(list(self.positions.columns), m.kmax)
                m.schema_version = SCHEMA_VERSION if signals else 1
                n_caps = len(m.caps) if m.caps else 0
                table = _positions_table(self.positions, m.kmax, signals, m.schema_version, n_caps)
                validate_positions(
                    table,
                    m.model,
                    m.kmax,
                    m.greedy,
                    file="positions (in memory)",
                    schema_version=m.schema_version,
                    vocab_size=m.vocab_size,
                    caps=m.caps,
                )
                files["positions"] = _write_table(table, tmp / "positions.parquet")
                m.counts["positions"] = table.num_rows
                m.counts["generations"] = int(self.positions["generation_id"].nunique())
            if self.rounds is not None:
                table = _rounds_table(self.rounds, m.schema_version)
                validate_rounds(table, m.model, m.kmax, file="rounds (in memory)")
                files["rounds"] = _write_table(table, tmp / "rounds.parquet")
                m.counts["rounds"] = table.num_rows
                m.counts.setdefault("generations", int(self.rounds["generation_id"].nunique()))
            if not files:
                raise ValueError("a trace set needs a positions or a rounds table")
            m.files = files
            Manifest.from_json(m.to_json(), "manifest (in memory)")  # refuse what load would refuse (caps...)
            atomic_write_json(tmp / MANIFEST, m.to_json())
        self.root = root
        return root


def _load_table(
    tab: str, path: Path, ent: dict[str, Any], manifest: Manifest, verified: dict[str, str] | None, check: bool = True
) -> pa.Table:
    """Read and validate one table named in the manifest (hash, row count and schema checked before reading).

    ``check=False`` skips the table's content checks (:func:`specenv.traces.schema.validate_positions`,
    ``validate_rounds``) for a table whose sha256 was verified and whose checks passed before.
    """
    try:
        check_regular(path)
    except FileNotFoundError:
        raise TraceError(str(path), "file named in the manifest is missing") from None
    except (IsADirectoryError, NotRegularFile) as exc:  # a folder, FIFO, device or socket (or a link to one)
        raise TraceError(str(path), f"file named in the manifest {exc.strerror}") from None
    except OSError as exc:
        raise TraceError(str(path), f"cannot read ({exc.strerror or exc.__class__.__name__})") from None
    if verified is not None:
        try:
            digest = sha256_file(path)
        except OSError as exc:
            raise TraceError(str(path), f"cannot read ({exc.strerror or exc.__class__.__name__})") from None
        if digest != ent["sha256"]:
            raise TraceError(str(path), "sha256 does not match the manifest")
        verified[tab] = ent["sha256"]
    table = _read_parquet(path, ent.get("rows"))
    meta = table.schema.metadata or {}
    sv = meta.get(b"specenv.schema_version")
    if sv is not None:
        # a table may be older than its manifest (v2 sets keep v1 rounds tables: the rounds did not change)
        allowed = [str(v) for v in SUPPORTED_SCHEMA_VERSIONS if v <= manifest.schema_version]
        if sv.decode(errors="replace") not in allowed:
            raise TraceError(
                str(path),
                f"Parquet schema_version {sv.decode(errors='replace')} is not one of {', '.join(allowed)} "
                f"(manifest schema_version {manifest.schema_version})",
            )
    if not check:
        return table
    if tab == "positions":
        validate_positions(
            table,
            manifest.model,
            manifest.kmax,
            manifest.greedy,
            file=str(path),
            schema_version=manifest.schema_version,
            vocab_size=manifest.vocab_size,
            caps=manifest.caps,
        )
    else:
        validate_rounds(table, manifest.model, manifest.kmax, file=str(path))
    return table


def _check_counts(manifest: Manifest, tables: dict[str, pa.Table | None], file: str) -> None:
    """The manifest's ``counts`` agree with the tables (rows per table, generations)."""
    counts = manifest.counts
    for tab, table in tables.items():
        if tab in counts and table is not None and counts[tab] != table.num_rows:
            raise TraceError(file, f"field 'counts.{tab}' = {counts[tab]}, but the table has {table.num_rows} rows")
        if tab in counts and table is None and counts[tab] != 0:
            raise TraceError(file, f"field 'counts.{tab}' = {counts[tab]}, but the set has no {tab} table")
    table = tables["positions"] if tables["positions"] is not None else tables["rounds"]
    if "generations" in counts and table is not None:
        n = len(np.unique(column_values(table, "generation_id", np.int64)))
        if counts["generations"] != n:
            raise TraceError(file, f"field 'counts.generations' = {counts['generations']}, but the tables hold {n}")


def _read_parquet(path: Path, rows: int | None = None) -> pa.Table:
    """Read a whole Parquet file (``ParquetFile``: unlike ``pq.read_table`` it does not import pandas).

    The row count the manifest declares is compared with the file's footer before anything is read.

    Raises:
        TraceError: Unreadable file, row count different from ``rows``, or too large to load.
    """
    try:
        with pq.ParquetFile(path) as pf:
            if rows is not None and pf.metadata.num_rows != rows:
                raise TraceError(str(path), f"has {pf.metadata.num_rows} rows, manifest says {rows}")
            return pf.read()
    except (pa.ArrowException, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise TraceError(str(path), f"not a readable Parquet file ({msg})") from None
    except MemoryError:
        raise TraceError(str(path), "too large to load into memory") from None


def _schema_meta(version: int = SCHEMA_VERSION) -> dict[bytes, bytes]:
    return {b"specenv.schema_version": str(version).encode()}


def _to_table(df: pd.DataFrame, columns: dict[str, pa.DataType], version: int = SCHEMA_VERSION) -> pa.Table:
    extra = [c for c in df.columns if c not in columns]
    arrays = []
    fields = []
    for name, typ in columns.items():
        if name not in df.columns:
            raise TraceError("(in memory)", "missing required column", column=name)
        if name == "category":
            arrays.append(pa.array(df[name].astype(str).to_numpy(object), type=pa.string()).dictionary_encode())
            fields.append(pa.field(name, pa.dictionary(pa.int32(), pa.string())))
        else:
            values = df[name].to_numpy()
            if pa.types.is_integer(typ) and values.dtype.kind == "f" and _is_cap_count(name):
                # a float count column is kept as float32 (the extension allows it) so that the
                # validator names the row of a fractional or missing value instead of pyarrow failing
                typ = pa.float32()
            arrays.append(pa.array(values, type=typ, from_pandas=True))
            fields.append(pa.field(name, typ))
    for name in extra:
        arr = pa.array(df[name], from_pandas=True)
        arrays.append(arr)
        fields.append(pa.field(name, arr.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=_schema_meta(version)))


def _is_cap_count(name: str) -> bool:
    """Whether ``name`` is a count column of the caps extension (``acc_c*_k*``, ``mis_c*_k*``)."""
    return name.startswith(("acc_c", "mis_c"))


def _positions_table(df: pd.DataFrame, kmax: int, signals: bool, version: int, n_caps: int = 0) -> pa.Table:
    return _to_table(df, positions_columns(kmax, signals=signals, n_caps=n_caps), version)


def _rounds_table(df: pd.DataFrame, version: int) -> pa.Table:
    return _to_table(df, ROUNDS_COLUMNS, version)


def _write_table(table: pa.Table, path: Path) -> dict[str, Any]:
    pq.write_table(table, path, compression="zstd", compression_level=9, use_dictionary=True)
    return {"path": path.name, "sha256": sha256_file(path), "rows": table.num_rows}


def is_trace_set(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a trace set and nothing else.

    Its ``manifest.json`` must parse as a JSON object with ``"format": "specenv.traces"``, and every
    other entry of the folder must be a table the manifest names. Only the manifest is read (its
    tables are not validated): this is the test for "may ``--overwrite`` replace it".
    """
    folder = Path(folder)
    from specenv.validation import read_json

    try:
        obj = read_json(folder / MANIFEST, what="manifest")  # size-bounded, duplicate keys refused
    except ValueError:
        return False
    if not isinstance(obj, dict) or obj.get("format") != "specenv.traces":
        return False
    files = obj.get("files")
    named = {MANIFEST}
    if isinstance(files, dict):
        named |= {ent["path"] for ent in files.values() if isinstance(ent, dict) and isinstance(ent.get("path"), str)}
    try:
        return all(entry.name in named for entry in os.scandir(folder))
    except OSError:
        return False


def check_save_destination(root: str | os.PathLike[str], overwrite: bool) -> None:
    """Check, before any work, that :meth:`TraceSet.save` may write ``root``.

    A missing ``root`` must be creatable (its nearest existing ancestor a writable folder). An existing
    one needs ``overwrite`` and must be a trace set (:func:`is_trace_set`) that may be replaced
    (:func:`specenv.io.check_replaceable`: not the working directory, a folder above it, home or the
    root, not a symbolic link).

    Raises:
        FileExistsError: ``root`` exists and ``overwrite`` is false.
        specenv.io.ReplaceRefused: ``root`` exists and may not be replaced.
        OSError: ``root`` cannot be created (an ancestor is a file, read-only, ...).
    """
    root = Path(root)
    if not os.path.lexists(root):
        check_new_path(root)
        return
    if not overwrite:
        raise FileExistsError(f"{root}: already exists (use --overwrite to replace a trace set)")
    check_replaceable(root)
    if not is_trace_set(root):
        raise ReplaceRefused(
            f"{root}: not a trace set (a specenv manifest.json and its tables only): refusing to replace it"
        )
