"""One validation layer for every file specenv reads: JSON files through pydantic models, npz headers, bounds.

Every JSON file specenv reads is parsed by :func:`read_json` (duplicate keys, deep nesting, huge
integers, non-UTF-8 bytes and unreadable files each become one line) and checked by :func:`check`
against one of the pydantic models below (strict types: no bool for an integer, no float for an
integer, so ``1e999`` is refused; finite floats; bounded integers; names without control
characters). The first problem becomes ONE line ``FILE: field 'a.b': problem``, raised as the
exception the caller already handles: :class:`specenv.traces.schema.TraceError` for trace sets (the caller
passes it as ``error``), :class:`ValueError` everywhere else (:func:`value_error`).

| file | model | read by |
|---|---|---|
| trace-set ``manifest.json`` | :class:`ManifestJSON` | :meth:`specenv.traces.traceset.Manifest.from_json` |
| cost-model JSON | :class:`CostModelJSON` | :meth:`specenv.cost.model.CostModel.from_json` |
| batch cost-model JSON | :class:`BatchCostModelJSON` | :meth:`specenv.cost.batch.BatchCostModel.from_json` |
| steps recording ``manifest.json`` | :class:`BatchStepsJSON` | :func:`specenv.cost.batchfit.load_steps` |
| ``policy.json`` (+ :func:`npz_headers`) | :class:`PolicyJSON` | :meth:`specenv.policy.mlp.MLPPolicy.load` |
| ``recording.json`` | :class:`RecordingJSON` | :mod:`specenv.engines.recorder` |
| recording part index ``parts/part-N.json`` | :class:`PartIndexJSON` | :mod:`specenv.engines.recorder` |
| prompt set | :class:`PromptSetJSON` | :func:`specenv.engines.hf.models.load_prompts` |
| model-set ``manifest.json`` | :class:`ModelSetJSON` | :func:`specenv.engines.hf.models.load_models` |

Bounds are checked before anything is allocated from them: :data:`KMAX_MAX` (the schema builds
column names from Kmax), :data:`N_EXPERTS_MAX`, :data:`N_LAYERS_MAX`, and the shapes of the arrays of
a ``weights.npz``, read from the ``.npy`` headers inside the zip before ``np.load`` allocates.

Cost models: coefficients must be finite, and every round the model can charge must cost something:
``T_T(K, U, L) > 0`` and ``T_D(n) >= 0`` over the whole domain (U from top_k to ``min((K+1)*top_k,
n_experts)``, L from 1 to :data:`CONTEXT_MAX`, n from 1 to Kmax). The model is linear, so checking the
corners is exact. Single coefficients may be slightly negative: an OLS intercept (beta0, d0) or a
context slope c within noise of zero is a legitimate fit, a negative charged cost is not.

pydantic is imported on first use (inside the functions), so ``import specenv`` does not load it.
An object validated once is not validated again: :func:`check` keeps its validated value in the disk
cache (:func:`specenv.io.cache_dir`, subfolder :data:`MEMO_SUBDIR`) under the sha256 of the model's
name, the object's JSON text and the validation code (this module, the schema, pydantic's version), so
a later process that reads the same file (the shipped trace set's manifest, a fitted cost model) gets
the same value without importing pydantic; anything else, an invalid object included, is validated.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

#: Largest draft budget any file may declare (the tables hold one column per budget).
KMAX_MAX = 64
#: Largest number of routed experts per MoE layer.
N_EXPERTS_MAX = 4096
#: Largest number of MoE layers.
N_LAYERS_MAX = 1024
#: Versioned extensions of the trace schema this specenv reads (manifest field ``extensions``).
TRACE_EXTENSIONS = ("caps-v1",)
#: Largest number of expert-cap levels a trace set may declare (the positions table has 4*Kmax columns per level).
CAP_LEVELS_MAX = 16
#: Largest generation cap a file may declare.
MAX_NEW_TOKENS_MAX = 1 << 24
#: Largest draft vocabulary a trace manifest may declare (bounds the entropy columns by its log).
VOCAB_MAX = 1 << 24
#: Longest context (tokens) over which a cost model must charge positive costs.
CONTEXT_MAX = 1 << 20
#: Longest time (ms) one round or batch step may record (about 2.8 hours): a larger value is not a timing,
#: and its squares would overflow a least-squares fit.
TIME_MS_MAX = 1e7
#: Longest step a batch cost model may charge at the corners of its domain (every request at CONTEXT_MAX).
BATCH_TIME_MS_MAX = TIME_MS_MAX * 1024
#: Largest JSON file read (bytes): manifests, cost models, policies and prompt sets are far smaller.
JSON_MAX_BYTES = 64 << 20
#: Most layers of a policy MLP, and most float elements in all its arrays together (64 MiB of float32).
POLICY_LAYERS_MAX = 64
POLICY_ELEMENTS_MAX = 1 << 24
#: Largest batch (requests per step) a batch cost model may cover, and most verified positions per step.
BATCH_MAX = 1024
BATCH_POSITIONS_MAX = BATCH_MAX * (KMAX_MAX + 1)
#: Longest name (trace set, source, category...).
NAME_MAX = 256

ErrorFactory = Callable[[str, str], Exception]


def one_line(text: str) -> str:
    """``text`` with every control character (newline, tab, escape...) written as a Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


def value_error(file: str, problem: str) -> ValueError:
    """The default error of a file: ``ValueError("FILE: problem")`` on one line."""
    return ValueError(one_line(f"{file}: {problem}"))


def _raise(error: ErrorFactory, file: str, problem: str) -> NoReturn:
    raise error(str(file), problem) from None


# ---------------------------------------------------------------------- reading JSON
class _DuplicateKeyError(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def parse_json(text: str, file: str, error: ErrorFactory = value_error, what: str = "file") -> Any:
    """Parse JSON text; duplicate keys, deep nesting and unparsable numbers are one line.

    Args:
        text: The JSON text.
        file: Name used in the message.
        error: Builds the exception from (file, problem).
        what: What the file is, for the message (``"cannot read policy: ..."``).
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKeyError as exc:
        _raise(error, file, f"cannot read {what}: duplicate key {exc.key!r}")
    except json.JSONDecodeError as exc:
        _raise(error, file, f"cannot read {what}: not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno})")
    except RecursionError:
        _raise(error, file, f"cannot read {what}: not valid JSON (nested too deeply)")
    except ValueError as exc:  # e.g. an integer literal longer than Python's digit limit
        _raise(error, file, f"cannot read {what}: not valid JSON ({str(exc).splitlines()[0][:200]})")


def read_json(path: str | os.PathLike[str], error: ErrorFactory = value_error, what: str = "file") -> Any:
    """Read and parse a JSON file; every failure (missing, unreadable, too big, not UTF-8, bad JSON) is one line."""
    from specenv.io import read_limited

    path = Path(path)
    file = str(path)
    try:
        data = read_limited(path, JSON_MAX_BYTES)  # regular files only, at most JSON_MAX_BYTES + 1 bytes read
    except FileNotFoundError:
        _raise(error, file, f"cannot read {what}: no such file")
    except PermissionError:
        _raise(error, file, f"cannot read {what}: permission denied")
    except OSError as exc:
        _raise(error, file, f"cannot read {what}: {exc.strerror or exc.__class__.__name__}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        _raise(error, file, f"cannot read {what}: not UTF-8 text (byte {exc.start})")
    return parse_json(text, file, error, what)


# ---------------------------------------------------------------------- checking against a model
def check(
    model: Any,
    obj: Any,
    file: str,
    error: ErrorFactory = value_error,
    formats: Sequence[str] | None = None,
    what: str = "file",
) -> Any:
    """Validate a parsed JSON object against one of this module's pydantic models (strict).

    Args:
        model: The model's name in this module (``"ManifestJSON"``...) or the class.
        obj: The parsed JSON.
        file: Name used in the message.
        error: Builds the exception from (file, problem).
        formats: Accepted values of the ``format`` field, checked first (None: not checked here).
        what: What the file should be, for the format message (``"not a specenv cost model"``).

    An object this specenv has validated before (the same model, the same JSON text, the same
    validation code and pydantic) is not validated again: its validated value is read back from the
    disk cache (:func:`_memo_read`), without importing pydantic.

    Returns:
        The validated model instance (from the cache: the same fields, as a :class:`Validated`).

    Raises:
        Exception: ``error(file, "field 'a.b': problem")`` for the first problem.
    """
    if not isinstance(obj, dict):
        _raise(error, file, f"must be a JSON object (got {_kind(obj)})")
    if formats is not None and obj.get("format") not in formats:
        _raise(error, file, f"not a {what}: field 'format' must be {formats[0]!r} (got {_short(obj.get('format'))})")
    key = _memo_key(model, obj) if isinstance(model, str) else None
    hit = _memo_read(key)
    if hit is not None:
        return hit
    from pydantic import ValidationError

    cls = _models()[model] if isinstance(model, str) else model
    try:
        valid = cls.model_validate(obj, strict=True)
    except ValidationError as exc:
        _raise(error, file, describe(exc))
    except RecursionError:
        _raise(error, file, "nested too deeply")
    _memo_write(key, valid)
    return valid


# ---------------------------------------------------------------------- validated once
#: Subfolder of :func:`specenv.io.cache_dir` holding validated values (one JSON file per object).
MEMO_SUBDIR = "validated"
#: Objects larger than this (characters of JSON) are validated every time, not kept.
MEMO_MAX_CHARS = 1 << 20


class Validated:
    """A validated model's fields read back from the cache: attribute access like the pydantic instance.

    Sub-models are :class:`Validated` too; dicts, lists, tuples and scalars are what pydantic returned.
    """

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, Any]):
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("validated values are read-only")

    def __repr__(self) -> str:
        return f"Validated({self._fields!r})"


@cache
def _memo_code() -> str | None:
    """Digest of what decides validity: the source of this module, the schema and the trace set, pydantic's version."""
    import hashlib
    import importlib.util

    h = hashlib.sha256()
    try:
        spec = importlib.util.find_spec("pydantic")
        traces = Path(__file__).with_name("traces")
        paths = [Path(__file__), traces / "schema.py", traces / "traceset.py"]
        if spec is None or not spec.submodule_search_locations:
            return None
        paths.append(Path(next(iter(spec.submodule_search_locations))) / "version.py")
        for path in paths:
            h.update(path.read_bytes())
    except (OSError, ImportError, ValueError):
        return None
    return h.hexdigest()


def _memo_key(model: str, obj: Any) -> str | None:
    """The cache key of one object: sha256 of the model name, the JSON text (key order kept), :func:`_memo_code`."""
    import hashlib

    code = _memo_code()
    if code is None:
        return None
    try:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        return None
    if len(text) > MEMO_MAX_CHARS:
        return None
    return hashlib.sha256(f"{model}\0{code}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()


def passed_before(what: str, material: Any) -> tuple[bool, str | None]:
    """Whether a check of ``material`` (JSON-able: everything the check's verdict depends on) passed before.

    For checks that return nothing but raise on the first problem (the trace tables' validation, keyed
    by the manifest that names every file's verified sha256). Returns ``(passed, key)``; after a check
    that passes, :func:`remember_pass` keeps ``key`` (None: no cache, nothing is kept).
    """
    key = _memo_key(what, material)
    path = None if key is None else _memo_path(key)
    if path is None:
        return False, None
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False, key
    return isinstance(entry, dict) and entry.get("key") == key and entry.get("passed") is True, key


def remember_pass(key: str | None) -> None:
    """Keep that the check of :func:`passed_before`'s ``key`` passed (skipped when the cache cannot be written)."""
    path = None if key is None else _memo_path(key)
    if path is None:
        return
    _keep(path, {"key": key, "passed": True})


def _memo_path(key: str) -> Path | None:
    from specenv.io import cache_dir

    root = cache_dir()
    return None if root is None else root / MEMO_SUBDIR / f"{key}.json"


def _encode(value: Any) -> Any:
    """Tagged JSON of a validated value: models, dicts, lists and tuples told apart."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        fields = {name: getattr(value, name) for name in type(value).model_fields}
        fields.update(value.model_extra or {})
        return {"m": {k: _encode(v) for k, v in fields.items()}}
    if isinstance(value, dict):
        return {"d": [[k, _encode(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"t": [_encode(v) for v in value]}
    if isinstance(value, list):
        return {"l": [_encode(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    raise TypeError(type(value).__name__)


def _decode(node: Any) -> Any:
    ((tag, body),) = node.items()
    if tag == "m":
        return Validated({k: _decode(v) for k, v in body.items()})
    if tag == "d":
        return {k: _decode(v) for k, v in body}
    if tag == "t":
        return tuple(_decode(v) for v in body)
    if tag == "l":
        return [_decode(v) for v in body]
    if tag == "v":
        return body
    raise ValueError(tag)


def _memo_read(key: str | None) -> Validated | None:
    """The validated value kept under ``key``, or None (no cache, no entry, or an entry that does not parse)."""
    path = None if key is None else _memo_path(key)
    if path is None:
        return None
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        if entry.get("key") != key:
            return None
        value = _decode(entry["value"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, Validated) else None


def _memo_write(key: str | None, valid: Any) -> None:
    """Keep a validated value under ``key`` (atomically; a cache that cannot be written is skipped)."""
    path = None if key is None else _memo_path(key)
    if path is None:
        return
    try:
        entry = {"key": key, "value": _encode(valid)}
    except (TypeError, ValueError, RecursionError):
        return
    _keep(path, entry)


#: Between :func:`hold_memo` and :func:`release_memo`: the entries held (else None: written at once).
_DEFERRED: list[tuple[Path, dict[str, Any]]] | None = None


def _keep(path: Path, entry: dict[str, Any]) -> None:
    """Write one cache entry atomically, or hold it until the command ends (:func:`hold_memo`)."""
    if _DEFERRED is not None:
        _DEFERRED.append((path, entry))
        return
    from specenv.io import atomic_write_json

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, entry)
    except (OSError, TypeError, ValueError, RecursionError):
        pass


def hold_memo() -> None:
    """Hold the cache entries written from now on until :func:`release_memo` (a command's start)."""
    global _DEFERRED
    if _DEFERRED is None:
        _DEFERRED = []


def release_memo(ok: bool) -> None:
    """End :func:`hold_memo`: write the held entries if the command ended well, else drop them.

    A refused command (one line, exit 2) or a failed one thus writes nothing, not even cache entries.
    """
    global _DEFERRED
    held, _DEFERRED = _DEFERRED or [], None
    if ok:
        for path, entry in held:
            _keep(path, entry)


def describe(exc: Any) -> str:
    """The first problem of a pydantic ``ValidationError`` as ``field 'a.b': problem (got TYPE)``."""
    e = exc.errors(include_url=False)[0]
    loc = ".".join(str(x) for x in e.get("loc", ()))
    msg = str(e.get("msg", "invalid")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    kind = e.get("type", "")
    if kind == "missing":
        return f"missing field '{loc}'"
    if kind == "extra_forbidden":
        return f"unknown field '{loc}'"
    if kind.endswith("_type"):
        msg = re.sub(r" or instance of \w+", "", msg) + f" (got {_kind(e.get('input'))})"
    return f"field '{loc}': {msg}" if loc else msg


def _kind(value: Any) -> str:
    return {bool: "bool", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------- npz headers
def npz_headers(
    path: str | os.PathLike[str], error: ErrorFactory = value_error, max_members: int = 1024
) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Shapes and dtypes of the arrays of an ``.npz``, read from the ``.npy`` headers inside the zip.

    Nothing is allocated from the declared shapes, so a small file that declares a huge array is
    refused by the caller before ``np.load`` reads it.

    Returns:
        ``{name: (shape, dtype)}`` (names without ``.npy``).

    Raises:
        Exception: ``error(file, problem)`` for a missing file, a file that is not a zip, a member that
            is not a ``.npy`` array, or an unreadable header.
    """
    import zipfile
    import zlib

    import numpy as np
    from numpy.lib import format as npf

    from specenv.io import NotRegularFile, open_regular

    file = str(path)
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    try:
        with open_regular(path) as raw, zipfile.ZipFile(raw) as zf:
            members = zf.infolist()
            if len(members) > max_members:
                _raise(error, file, f"holds {len(members)} arrays (more than {max_members})")
            for zi in members:
                if not zi.filename.endswith(".npy"):
                    _raise(error, file, f"member {zi.filename!r} is not a .npy array")
                name = zi.filename[: -len(".npy")]
                try:
                    with zf.open(zi) as fh:
                        version = npf.read_magic(fh)
                        if version == (1, 0):
                            shape, _, dtype = npf.read_array_header_1_0(fh)
                        else:
                            shape, _, dtype = npf.read_array_header_2_0(fh)
                except (OSError, ValueError, EOFError, zlib.error, TypeError, zipfile.BadZipFile) as exc:
                    msg = str(exc).splitlines()[0][:200] if str(exc) else exc.__class__.__name__
                    _raise(error, file, f"array '{name}': unreadable .npy header ({msg})")
                out[name] = (tuple(int(n) for n in shape), np.dtype(dtype))
    except FileNotFoundError:
        _raise(error, file, "no such file")
    except PermissionError:
        _raise(error, file, "cannot read (permission denied)")
    except IsADirectoryError:
        _raise(error, file, "is a folder, not a file")
    except NotRegularFile as exc:
        _raise(error, file, f"cannot read ({exc.strerror})")
    except zipfile.BadZipFile as exc:
        _raise(error, file, f"not a valid npz (zip) file ({exc})")
    except (OSError, ValueError, EOFError, zlib.error, TypeError) as exc:
        msg = str(exc).splitlines()[0][:200] if str(exc) else exc.__class__.__name__
        _raise(error, file, f"unreadable array header ({msg})")
    return out


# ---------------------------------------------------------------------- the models
def check_name(value: str) -> str:
    """A name printed on one line: no control characters (newlines, tabs, escapes), at most NAME_MAX chars."""
    if any(unicodedata.category(c).startswith("C") for c in value):
        raise ValueError("contains a control character (newline, tab, escape...)")
    if len(value) > NAME_MAX:
        raise ValueError(f"longer than {NAME_MAX} characters")
    return value


def check_set_name(value: str) -> str:
    """A trace set's name: a :func:`check_name` that can be one part of a path (datasets are named after it)."""
    check_name(value)
    if not value or value in (".", "..") or "/" in value or "\\" in value:
        raise ValueError(f"must not hold a path separator nor be '.' or '..' (got {value!r})")
    return value


def check_file_name(value: str) -> str:
    """A plain file name inside the folder: no separator, not hidden, not ``..``, not absolute."""
    check_name(value)
    if not value or "/" in value or "\\" in value or value.startswith(".") or os.path.isabs(value):
        raise ValueError(f"must be a plain file name inside the folder (got {value!r})")
    return value


def check_relative_path(value: str) -> str:
    """A relative path inside the folder: no ``..`` part, not absolute, no backslash, no empty part."""
    check_name(value)
    parts = value.split("/")
    if not value or value.startswith("/") or "\\" in value or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"must be a relative path inside the folder (got {value!r})")
    return value


@cache
def _models() -> dict[str, Any]:
    """Build the pydantic models (once, on first use: pydantic is imported only here)."""
    from typing import Annotated, Literal

    from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

    Name = Annotated[str, AfterValidator(check_name)]
    SetName = Annotated[str, AfterValidator(check_set_name)]
    FileName = Annotated[str, AfterValidator(check_file_name)]
    RelPath = Annotated[str, AfterValidator(check_relative_path)]
    Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    Finite = Annotated[float, Field(allow_inf_nan=False)]
    Count = Annotated[int, Field(ge=0)]

    class Strict(BaseModel):
        model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    class Open(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    class ModelFactsJSON(Strict):
        n_layers: Annotated[int, Field(ge=1, le=N_LAYERS_MAX)]
        n_experts: Annotated[int, Field(ge=1, le=N_EXPERTS_MAX)]
        top_k: Annotated[int, Field(ge=1, le=N_EXPERTS_MAX)]

        @model_validator(mode="after")
        def _top_k(self) -> ModelFactsJSON:
            if self.top_k > self.n_experts:
                raise ValueError(f"needs 1 <= top_k <= n_experts (top_k={self.top_k}, n_experts={self.n_experts})")
            return self

    class TraceFileJSON(Strict):
        path: FileName
        sha256: Sha256
        rows: Count | None = None

    class CountsJSON(Strict):
        generations: Count | None = None
        positions: Count | None = None
        rounds: Count | None = None

    class ManifestJSON(Strict):
        """A trace set's ``manifest.json`` (unknown fields are refused: a typo is never ignored)."""

        format: Literal["specenv.traces"]
        schema_version: int
        name: SetName
        version: Count = 1
        description: str = ""
        source: Name
        profile: Name
        greedy: bool
        model: ModelFactsJSON
        kmax: Annotated[int, Field(ge=1, le=KMAX_MAX)]
        max_new_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS_MAX)] = 1000
        vocab_size: Annotated[int, Field(ge=2, le=VOCAB_MAX)] | None = None
        counts: CountsJSON = CountsJSON()
        files: dict[str, TraceFileJSON]
        extra: dict[str, Any] = {}
        caps: list[Annotated[int, Field(ge=1, le=N_EXPERTS_MAX)]] | None = None
        extensions: list[str] = []

        @model_validator(mode="after")
        def _caps(self) -> ManifestJSON:
            unknown = [e for e in self.extensions if e not in TRACE_EXTENSIONS]
            if unknown:
                raise ValueError(
                    f"field 'extensions': unknown extension {unknown[0]!r} "
                    f"(this specenv reads {', '.join(TRACE_EXTENSIONS)})"
                )
            if len(set(self.extensions)) != len(self.extensions):
                raise ValueError("field 'extensions': an extension is listed twice")
            has_ext = "caps-v1" in self.extensions
            if has_ext != (self.caps is not None):
                raise ValueError("field 'caps' and extension 'caps-v1' go together (one is missing)")
            if self.caps is not None:
                caps = self.caps
                if not 1 <= len(caps) <= CAP_LEVELS_MAX:
                    raise ValueError(f"field 'caps': needs 1..{CAP_LEVELS_MAX} levels (got {len(caps)})")
                if any(b >= a for a, b in zip(caps[1:], caps[:-1], strict=False)):
                    raise ValueError(f"field 'caps': must be strictly ascending (got {caps})")
                if caps[-1] >= self.model.n_experts:
                    raise ValueError(
                        f"field 'caps': every cap must be < n_experts={self.model.n_experts} (got {caps[-1]})"
                    )
            return self

        @field_validator("files")
        @classmethod
        def _files(cls, files: dict[str, Any]) -> dict[str, Any]:
            if not files or any(k not in ("positions", "rounds") for k in files):
                raise ValueError("must name one or both of ('positions', 'rounds')")
            if len({f.path for f in files.values()}) != len(files):
                raise ValueError("the tables must be different files")
            return files

    class TargetRowJSON(Strict):
        beta0: Finite
        alpha: Finite
        c: Finite
        overhead: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0  # engine ms per step outside the forwards

    class ARStepJSON(Strict):
        a: Annotated[float, Field(gt=0, allow_inf_nan=False)]  # a plain engine's step: a + c * L ms
        c: Finite

    class DraftJSON(Strict):
        d1: Finite
        d0: Finite
        floor: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0  # draft ms of a k = 0 round (vLLM)

    class CostModelJSON(Strict):
        """A cost model (``specenv fit --out``); see the module docstring for the cost rules."""

        format: str
        kmax: Annotated[int, Field(ge=1, le=KMAX_MAX)]
        top_k: Annotated[int, Field(ge=1, le=N_EXPERTS_MAX)]
        n_experts: Annotated[int, Field(ge=1, le=N_EXPERTS_MAX)] | None = None
        n_layers: Annotated[int, Field(ge=1, le=N_LAYERS_MAX)] | None = None
        target: dict[str, TargetRowJSON]
        draft: DraftJSON
        ar_extrapolated: bool = False
        ar_step: ARStepJSON | None = None
        source: dict[str, Any] = {}
        diagnostics: dict[str, Any] = {}

        @model_validator(mode="after")
        def _consistent(self) -> CostModelJSON:
            want = [str(k) for k in range(self.kmax + 1)]
            if sorted(self.target, key=lambda s: (len(s), s)) != want:
                raise ValueError(f"field 'target' must hold exactly the budgets '0'..'{self.kmax}' (kmax)")
            if self.n_experts is not None and self.top_k > self.n_experts:
                raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
            problem = cost_problem(
                [self.target[k].beta0 for k in want],
                [self.target[k].alpha for k in want],
                [self.target[k].c for k in want],
                self.draft.d1,
                self.draft.d0,
                self.top_k,
                self.n_experts,
            )
            if problem is not None:
                raise ValueError(problem)
            return self

    class BatchVerifyJSON(Strict):
        beta0: Annotated[list[Finite], Field(min_length=1, max_length=BATCH_POSITIONS_MAX)]
        alpha: Annotated[list[Finite], Field(min_length=1, max_length=BATCH_POSITIONS_MAX)]
        c: Annotated[list[Finite], Field(min_length=1, max_length=BATCH_POSITIONS_MAX)]
        b_req: Finite
        #: ms per request verifying an even budget k >= 2 (BatchCostModel.b_odd_query); >= 0
        b_odd_query: Annotated[float, Field(ge=0, le=BATCH_TIME_MS_MAX, allow_inf_nan=False)] = 0.0

    class BatchDraftJSON(Strict):
        d0: Finite
        d_step: Finite
        d_tok: Finite

    class UBatchJSON(Strict):
        predictor: Literal["independent", "shared", "pooled"]
        u_theta: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
        #: the "pooled" predictor's effective pool (BatchCostModel.u_pool; top_k..n_experts, checked there)
        u_pool: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None

    class BatchArStepJSON(Strict):
        a_ms: Annotated[float, Field(gt=0, le=BATCH_TIME_MS_MAX, allow_inf_nan=False)]
        b_req_ms: Annotated[float, Field(ge=0, le=BATCH_TIME_MS_MAX, allow_inf_nan=False)]
        c_ms_per_token: Annotated[float, Field(ge=0, le=BATCH_TIME_MS_MAX, allow_inf_nan=False)]
        u_ms_per_expert: Annotated[float, Field(ge=0, le=BATCH_TIME_MS_MAX, allow_inf_nan=False)] = 0.0
        #: measured minus the form per B = 1..max_batch (BatchCostModel.ar_by_batch); may be negative
        by_batch_ms: (
            list[Annotated[float, Field(ge=-BATCH_TIME_MS_MAX, le=BATCH_TIME_MS_MAX, allow_inf_nan=False)]] | None
        ) = None

    class BatchPrefillJSON(Strict):
        """One engine's prefill phase of a group: ``a_ms + b_ms_per_token * prompt tokens``."""

        a_ms: Annotated[float, Field(ge=0, le=BATCH_TIME_MS_MAX, allow_inf_nan=False)]
        b_ms_per_token: Annotated[float, Field(ge=0, le=BATCH_TIME_MS_MAX, allow_inf_nan=False)]

    class BatchCostModelJSON(Strict):
        """A batch cost model (:mod:`specenv.cost.batch`); every charged step time must be positive."""

        format: str
        kmax: Annotated[int, Field(ge=1, le=KMAX_MAX)]
        max_batch: Annotated[int, Field(ge=1, le=BATCH_MAX)]
        model: ModelFactsJSON
        verify: BatchVerifyJSON
        draft: BatchDraftJSON
        u_batch: UBatchJSON
        overhead: list[Annotated[float, Field(ge=0, le=BATCH_TIME_MS_MAX, allow_inf_nan=False)]] | None = None
        ar_step: BatchArStepJSON | None = None
        prefill: dict[Literal["spec", "plain"], BatchPrefillJSON] | None = None
        source: dict[str, Any] = {}
        diagnostics: dict[str, Any] = {}

        @model_validator(mode="after")
        def _consistent(self) -> BatchCostModelJSON:
            n_pos = self.max_batch * (self.kmax + 1)
            if self.overhead is not None and len(self.overhead) != self.max_batch:
                raise ValueError(
                    f"field 'overhead' must hold max_batch = {self.max_batch} values (got {len(self.overhead)})"
                )
            for name in ("beta0", "alpha", "c"):
                if len(getattr(self.verify, name)) != n_pos:
                    raise ValueError(
                        f"field 'verify.{name}' must hold max_batch * (kmax+1) = {n_pos} values "
                        f"(got {len(getattr(self.verify, name))})"
                    )
            problem = batch_cost_problem(
                self.verify.beta0,
                self.verify.alpha,
                self.verify.c,
                self.verify.b_req,
                (self.draft.d0, self.draft.d_step, self.draft.d_tok),
                self.kmax,
                self.max_batch,
                self.model.top_k,
                self.model.n_experts,
            )
            if problem is not None:
                raise ValueError(problem)
            return self

    class BatchStepsJSON(Strict):
        """A steps recording's ``manifest.json`` (:mod:`specenv.cost.batchfit`)."""

        format: str
        name: Name
        version: Count = 1
        description: str = ""
        model: ModelFactsJSON
        kmax: Annotated[int, Field(ge=1, le=KMAX_MAX)]
        max_batch: Annotated[int, Field(ge=1, le=BATCH_MAX)]
        files: dict[Literal["steps", "plain"], TraceFileJSON]
        extra: dict[str, Any] = {}

        @field_validator("files")
        @classmethod
        def _steps(cls, files: dict[str, Any]) -> dict[str, Any]:
            if "steps" not in files:
                raise ValueError("must name the 'steps' table")
            return files

    class PolicyJSON(Strict):
        """``policy.json`` of an exported MLP policy (the observation contract is checked by its owner)."""

        format: str
        kind: Literal["mlp"]
        name: Name = "mlp"
        activation: Literal["tanh", "relu"] = "tanh"
        layers: Annotated[int, Field(ge=1, le=POLICY_LAYERS_MAX)]
        observation: dict[str, Any]
        meta: dict[str, Any] = {}

        @field_validator("observation")
        @classmethod
        def _bounded(cls, obs: dict[str, Any]) -> dict[str, Any]:
            # bounds before the contract builds its feature names from them
            for key, lo in (("kmax", 1), ("lookahead", 0), ("n_experts", 1), ("max_new_tokens", 1), ("dim", 1)):
                if key not in obs:
                    continue
                v = obs[key]
                hi = {"kmax": KMAX_MAX, "lookahead": KMAX_MAX, "n_experts": N_EXPERTS_MAX}.get(key, MAX_NEW_TOKENS_MAX)
                if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                    raise ValueError(f"'{key}' must be an integer in {lo}..{hi} (got {_short(v)})")
            return obs

    class RecordingJSON(Open):
        """A recording's ``recording.json`` (fields the recorder adds later are allowed)."""

        format: str
        schema_version: int | None = None
        source: Name = "vllm"
        name: Name = "recording"
        model: ModelFactsJSON
        kmax: Annotated[int, Field(ge=1, le=KMAX_MAX)]
        max_new_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS_MAX)] = 1000
        extra: dict[str, Any] = {}
        previous_runs: list[Any] = []

    class PartIndexJSON(Open):
        """The index of one recorded part: written after its Parquet file, carries the file's sha256."""

        format: str
        part: Count | None = None
        path: FileName
        sha256: Sha256
        rows: Count
        first_step: int | None = None
        last_step: int | None = None

    class PromptJSON(Strict):
        id: Count
        category: Name
        text: str
        file: str = ""
        line: Count = 0

    class PromptSetJSON(Open):
        """A prompt set: ``{"prompts": [{id, category, text, file, line}, ...]}`` with distinct ids."""

        prompts: Annotated[list[PromptJSON], Field(min_length=1, max_length=1_000_000)]

        @field_validator("prompts")
        @classmethod
        def _ids(cls, prompts: list[Any]) -> list[Any]:
            seen: set[int] = set()
            for i, p in enumerate(prompts):
                if p.id in seen:
                    raise ValueError(f"prompt {i} repeats id {p.id} (ids are generation ids: distinct)")
                seen.add(p.id)
            return prompts

    class ModelFileJSON(Open):
        sha256: Sha256
        bytes: Count | None = None

    class ModelSetJSON(Open):
        """A model set's ``manifest.json``: the sha256 of every file, by path relative to the folder."""

        name: Name | None = None
        files: dict[RelPath, ModelFileJSON] = {}

    return {
        cls.__name__: cls
        for cls in (
            ModelFactsJSON,
            ManifestJSON,
            CostModelJSON,
            BatchCostModelJSON,
            BatchStepsJSON,
            PolicyJSON,
            RecordingJSON,
            PartIndexJSON,
            PromptSetJSON,
            ModelSetJSON,
        )
    }


def cost_problem(
    beta0: Sequence[float],
    alpha: Sequence[float],
    c: Sequence[float],
    d1: float,
    d0: float,
    top_k: int,
    n_experts: int | None = None,
) -> str | None:
    """Why a cost model would charge an impossible cost, or None (rules: see the module docstring).

    Args:
        beta0: Intercepts per budget K = 0..kmax.
        alpha: ms per unique expert per K.
        c: ms per context token per K.
        d1: Draft ms per drafted token.
        d0: Draft ms per round.
        top_k: Experts per token.
        n_experts: Experts per layer, when known (caps U).

    Returns:
        One phrase naming the field, or None when the model is sane.
    """
    import math

    kmax = len(beta0) - 1
    for name, arr in (("beta0", beta0), ("alpha", alpha), ("c", c)):
        for k, v in enumerate(arr):
            if not math.isfinite(v):
                return f"field 'target.{k}.{name}' must be finite (got {v})"
    for name, v in (("d1", d1), ("d0", d0)):
        if not math.isfinite(v):
            return f"field 'draft.{name}' must be finite (got {v})"
    for k in range(kmax + 1):
        u_hi = (k + 1) * top_k if n_experts is None else min((k + 1) * top_k, n_experts)
        for u in (top_k, max(top_k, u_hi)):
            for L in (1, CONTEXT_MAX):
                t = beta0[k] + alpha[k] * u + c[k] * L
                if not t > 0:
                    return (
                        f"field 'target.{k}': charges a verification time {t:.4g} ms <= 0 "
                        f"(U={u}, L={L}; beta0={beta0[k]}, alpha={alpha[k]}, c={c[k]})"
                    )
                if t > TIME_MS_MAX:
                    return (
                        f"field 'target.{k}': charges a verification time {t:.4g} ms > {TIME_MS_MAX:g} "
                        f"(U={u}, L={L}; beta0={beta0[k]}, alpha={alpha[k]}, c={c[k]}): not a plausible time"
                    )
    for n in (1, max(1, kmax)):
        if d1 * n + d0 < 0:
            return f"field 'draft': charges a draft time {d1 * n + d0:.4g} ms < 0 for {n} tokens (d1={d1}, d0={d0})"
        if d1 * n + d0 > TIME_MS_MAX:
            return (
                f"field 'draft': charges a draft time {d1 * n + d0:.4g} ms > {TIME_MS_MAX:g} for {n} tokens "
                f"(d1={d1}, d0={d0}): not a plausible time"
            )
    return None


def batch_cost_problem(
    beta0: Sequence[float],
    alpha: Sequence[float],
    c: Sequence[float],
    b_req: float,
    draft: tuple[float, float, float],
    kmax: int,
    max_batch: int,
    top_k: int,
    n_experts: int,
) -> str | None:
    """Why a batch cost model would charge an impossible step time, or None.

    For every step size P, the verification time ``beta0 + alpha*U + c*sumL + b_req*(B-1)`` must be
    positive at every corner of its domain (B from ceil(P/(kmax+1)) to min(P, max_batch), U from top_k
    to min(n_experts, P*top_k), sumL from B to B*CONTEXT_MAX; it is linear, so the corners suffice), and
    the draft time ``d0 + d_step*max + d_tok*sum`` non-negative for max in 1..kmax and sum in
    max..max_batch*max.

    Returns:
        One phrase naming the field, or None when the model is sane.
    """
    for P in range(1, max_batch * (kmax + 1) + 1):
        b_lo, b_hi = -(-P // (kmax + 1)), min(P, max_batch)
        u_hi = max(top_k, min(n_experts, P * top_k))
        i = P - 1
        for B in (b_lo, b_hi):
            for u in (top_k, u_hi):
                for L in (B, B * CONTEXT_MAX):
                    t = beta0[i] + alpha[i] * u + c[i] * L + b_req * (B - 1)
                    if t > BATCH_TIME_MS_MAX:
                        return (
                            f"field 'verify': charges a verification time {t:.4g} ms > {BATCH_TIME_MS_MAX:g} at "
                            f"P={P} positions (B={B}, U={u}, sum L={L}): not a plausible time"
                        )
                    if not t > 0:
                        return (
                            f"field 'verify': charges a verification time {t:.4g} ms <= 0 at P={P} positions "
                            f"(B={B}, U={u}, sum L={L}; beta0={beta0[i]}, alpha={alpha[i]}, c={c[i]}, b_req={b_req})"
                        )
    d0, d_step, d_tok = draft
    for top in (1, kmax):
        for total in (top, max_batch * top):
            t = d0 + d_step * top + d_tok * total
            if not t <= BATCH_TIME_MS_MAX:
                return f"field 'draft': charges a draft time {t:.4g} ms > {BATCH_TIME_MS_MAX:g}: not a plausible time"
            if t < 0:
                return f"field 'draft': charges a draft time {t:.4g} ms < 0 (max {top}, sum {total} drafted tokens)"
    return None
