"""Offline-RL datasets: a policy's episodes on a trace set as a Minari dataset, and reading them back.

`Minari <https://minari.farama.org>`_ is the Farama standard for offline-RL datasets. specenv's traces
stay its own format (traces/README.md); what goes to Minari are *rollouts*: the episodes a policy
plays in the replay environment ``specenv/MoESpec-v1`` on one split of a trace set, written by
Minari's own :func:`minari.create_dataset_from_buffers` from one ``EpisodeBuffer`` per episode (the
observations, the budgets k as actions, the rewards, terminations, each episode's reset seed and
``generation_id`` option). Minari's ``DataCollector`` wrapper would record the same but needs jax
(``minari[create]``) to append steps. Any policy can be exported (:func:`build_policy`): the oracle's
k*(t) as expert data (:class:`policies.learn.expert.OracleExpert`), a registered heuristic or peer by name
(:mod:`specenv.policy.registry`), a policy shipped for the set by its folder name (``imitation``,
``ppo-h3``, ``imitation-seq``...) or any policy folder.

Dataset ids are versioned, ``specenv/<set>/<policy>-v0`` (:func:`dataset_id`; a Minari namespace per
trace set; the oracle and registered names in mode block or sequential get ``-hH`` / ``-seq`` after the
name). Each dataset records:

* the environment's ``EnvSpec`` (id and every constructor argument, JSON), so
  ``dataset.recover_environment()`` rebuilds the very environment the episodes came from;
* its observation and action spaces (Minari's own fields);
* under the metadata key ``"specenv"`` (:data:`METADATA_KEY`): the trace set (name, id, manifest
  sha256 — the manifest lists the sha256 of every table), the split, the cost model, the drafting
  mode, the policy (its name, its kind, the sha256 of its ``policy.json`` and ``weights.npz`` or, for
  the oracle, of its k*(t) table), the full observation contract and its version, and the
  episodes' pooled speedup.

**Where datasets go.** Minari keeps datasets under ``~/.minari/datasets`` unless
``MINARI_DATASETS_PATH`` says otherwise. specenv never writes into a folder of the user's it was not
asked to: the root is ``--root`` when given, else ``$MINARI_DATASETS_PATH`` when the user set it, else
``minari/`` inside specenv's cache folder (:func:`specenv.io.cache_dir`; :func:`resolve_root`). The
dataset is built by Minari in a hidden staging folder inside the root and moved into place only when
complete (nothing half-written); an existing dataset is replaced only with ``overwrite`` and only if
specenv exported it (its metadata has the ``"specenv"`` block); the staging folder, the only other
thing written, is removed (and one that a killed export left is removed by the next export, once its
process is gone: :func:`specenv.io.remove_stale_temporaries`). Minari's remote functions (download,
upload, the hub) are never called: no network.

Reading back (:func:`open_dataset`) checks, with one line naming the problem, that the id is well
formed and present under the root, that specenv wrote it, that its environment is specenv's replay
environment, and that the environment it recovers has the recorded observation contract and spaces
(the contract of this code: a dataset of an older contract is refused).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from policies.learn.expert import ORACLE_POLICY, OracleExpert

#: The environment Minari datasets of specenv are recorded in.
ENV_ID = "specenv/MoESpec-v1"
#: Minari's storage format: Arrow (pyarrow, which specenv needs anyway; no h5py).
DATA_FORMAT = "arrow"
#: Minari's environment variable for its datasets folder.
ROOT_ENV = "MINARI_DATASETS_PATH"
#: The key of specenv's block in a dataset's metadata.
METADATA_KEY = "specenv"
#: Version of that block's layout.
FORMAT = "specenv.minari/1"
#: Name of the staging folder in the root (hidden: ``.specenv-staging.<pid>.<8 hex>``, Minari lists no hidden folder).
STAGING = "specenv-staging"
#: The version of every id :func:`dataset_id` makes.
ID_VERSION = 0
_SAFE = re.compile(r"[^-\w]+")


def _minari() -> Any:
    """Import Minari (the optional ``minari`` extra) or say how to install it."""
    try:
        import minari
    except ImportError:
        raise ValueError('Minari is not installed: pip install "specenv[minari]" (minari[arrow]==0.5.4)') from None
    return minari


# ------------------------------------------------------------------ root and ids
def resolve_root(root: str | os.PathLike[str] | None = None) -> Path:
    """The Minari datasets folder specenv uses: ``root``, else ``$MINARI_DATASETS_PATH``, else the cache's ``minari/``.

    Raises:
        ValueError: When no root is given, ``MINARI_DATASETS_PATH`` is unset and the cache is disabled.
    """
    if root is not None:
        return Path(os.path.abspath(Path(root).expanduser()))  # Minari joins relative paths twice
    env = os.environ.get(ROOT_ENV)
    if env:
        return Path(os.path.abspath(Path(env).expanduser()))
    from specenv.io import cache_dir

    cache = cache_dir()
    if cache is None:
        raise ValueError(f"--root: no Minari folder (the specenv cache is disabled and {ROOT_ENV} is unset)")
    return Path(os.path.abspath(cache / "minari"))


@contextmanager
def minari_root(root: Path) -> Iterator[None]:
    """Point Minari at ``root`` (``MINARI_DATASETS_PATH``) for the block; the old value comes back after."""
    old = os.environ.get(ROOT_ENV)
    os.environ[ROOT_ENV] = str(root)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ROOT_ENV, None)
        else:
            os.environ[ROOT_ENV] = old


def safe_name(text: str) -> str:
    """``text`` as a Minari name part: runs of characters outside ``[-_A-Za-z0-9]`` become ``-``."""
    out = _SAFE.sub("-", text).strip("-")
    if not out:
        raise ValueError(f"{text!r}: no letter or digit to name a dataset with")
    return out


def set_name(traces: str) -> str:
    """The trace set's name in a dataset id: the registered name, or a folder's manifest name."""
    from specenv.traces.datasets import find_dataset, load_dataset

    ds = find_dataset(traces)
    if ds is not None:
        return ds.name
    return safe_name(str(load_dataset(traces).manifest.name))


def dataset_id(traces: str, policy: str, version: int = ID_VERSION, plan: ExportPolicy | None = None) -> str:
    """``specenv/<set>/<policy>[-hH|-seq]-v<version>``.

    A policy folder is named by its folder name (which says its mode, as the shipped ``imitation-h3``
    does). The oracle and registered names take the suffix of their drafting mode when ``plan``
    gives one other than ``none`` (``-hH`` for block with h, ``-seq`` for sequential; the suffixes of
    ``specenv train``'s run names), so the same policy in two modes gets two ids.
    """
    name = Path(policy).name if (Path(policy) / "policy.json").is_file() else policy
    if plan is not None and plan.kind != "folder":
        name += {"none": "", "block": f"-h{plan.lookahead}", "sequential": "-seq"}[plan.drafting]
    return f"specenv/{set_name(traces)}/{safe_name(name)}-v{int(version)}"


def check_id(ident: str) -> tuple[str | None, str, int]:
    """Parse a Minari dataset id with Minari's own parser (``(namespace/)name-vN``).

    Raises:
        ValueError: For a malformed id, or one without ``-vN``.
    """
    from minari.dataset.minari_dataset import parse_dataset_id

    if not re.search(r"-v\d+$", ident):
        raise ValueError(f"{ident!r}: a dataset id ends with its version, -vN (e.g. specenv/paper-default/oracle-v0)")
    try:
        return parse_dataset_id(ident)
    except ValueError:
        raise ValueError(f"{ident!r}: malformed Minari dataset id (expected namespace/name-vN)") from None


def dataset_path(root: Path, ident: str) -> Path:
    """The folder of dataset ``ident`` under ``root`` (Minari's layout: ``root/<id>/data``)."""
    return root.joinpath(*ident.split("/"))


def exported_by_specenv(folder: Path) -> bool:
    """Whether ``folder`` holds a Minari dataset whose metadata has specenv's block."""
    meta = folder / "data" / "metadata.json"
    if folder.is_symlink() or not meta.is_file():
        return False
    from specenv.io import read_limited
    from specenv.validation import JSON_MAX_BYTES

    try:
        doc = json.loads(read_limited(meta, JSON_MAX_BYTES))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get(METADATA_KEY), dict)


#: Files of an Arrow-format Minari dataset folder, below ``data/<episode id>/``.
_EPISODE_FILE = re.compile(r"(metadata\.json|part-\d+\.arrow)")


def foreign_entry(folder: Path) -> Path | None:
    """The first path under a dataset folder that neither Minari nor specenv writes (None: there is none).

    An exported dataset holds ``data/metadata.json`` and one ``data/<episode id>/`` folder per episode
    with ``metadata.json`` and ``part-N.arrow`` files, nothing else; a user's notes, a link or another
    folder put there would be deleted by a replacement, so ``--overwrite`` refuses such a folder.
    """
    top = sorted(folder.iterdir())
    for p in top:
        if p.name != "data" or p.is_symlink() or not p.is_dir():
            return p
    for p in sorted((folder / "data").iterdir()):
        if p.is_symlink():
            return p
        if p.name == "metadata.json" and p.is_file():
            continue
        if not (p.is_dir() and p.name.isdigit()):
            return p
        for q in sorted(p.iterdir()):
            if q.is_symlink() or not q.is_file() or not _EPISODE_FILE.fullmatch(q.name):
                return q
    return None


def check_destination(root: Path, ident: str, overwrite: bool) -> Path:
    """Where ``ident`` will be written; refuse an existing one unless ``overwrite`` and specenv wrote it.

    Raises:
        FileExistsError: The dataset exists and ``overwrite`` is false.
        ValueError: ``overwrite`` of a folder that is not a dataset specenv exported, or that holds a
            file specenv did not write there (:func:`foreign_entry`).
        OSError: Nothing can be created under ``root``.
    """
    from specenv.io import check_new_path

    dest = dataset_path(root, ident)
    if os.path.lexists(dest):
        if not overwrite:
            raise FileExistsError(f"{dest}: dataset {ident} already exists (use --overwrite to replace it)")
        if not exported_by_specenv(dest):
            raise ValueError(f"{dest}: not a Minari dataset exported by specenv: refusing to replace it")
        extra = foreign_entry(dest)
        if extra is not None:
            where = extra.relative_to(dest)
            raise ValueError(f"{dest}: holds {where}, which specenv did not write: refusing to replace it")
    else:
        check_new_path(dest)
    return dest


# ------------------------------------------------------------------ policies
@dataclass
class ExportPolicy:
    """A policy to export and the environment settings it needs.

    Attributes:
        name: The ``--policy`` string.
        kind: ``"oracle"``, ``"folder"`` (a policy folder or a shipped policy) or ``"registered"``.
        drafting: Drafting mode of the environment.
        lookahead: Its h.
        signals: Draft signals of the lookahead block.
        folder: The policy folder (kind ``"folder"``).
        per_token: A stop rule of the per-token environment (run through :mod:`policies.learn.stopping`).
    """

    name: str
    kind: str
    drafting: str
    lookahead: int
    signals: tuple[str, ...] = ("q",)
    folder: Path | None = None
    per_token: bool = False

    def files_sha256(self) -> dict[str, str] | None:
        """sha256 of ``policy.json`` and ``weights.npz`` of a folder policy (None otherwise)."""
        if self.folder is None:
            return None
        from specenv.io import sha256_file

        return {f: sha256_file(self.folder / f) for f in ("policy.json", "weights.npz")}


def plan_policy(
    policy: str,
    traces: str,
    kmax: int,
    drafting: str | None = None,
    lookahead: int | None = None,
    signals: tuple[str, ...] | None = None,
) -> ExportPolicy:
    """Resolve ``--policy`` and the drafting settings of the environment it runs in.

    A policy folder (or a policy shipped for ``traces``, by its folder name) brings its own lookahead,
    signals and mode (a stop rule runs in ``sequential``, h = kmax); a ``--drafting`` or
    ``--lookahead`` that contradicts it is refused. The oracle and registered names take the
    settings given (:func:`specenv.cost.model.check_drafting`; default mode ``none``) and ``signals``
    (default ``("q",)``; the entropy-based peers need ``("q", "ent")``).

    Raises:
        ValueError: One line naming ``--policy``, ``--drafting``, ``--lookahead`` or ``--signals``.
    """
    from policies import shipped_policy_dir
    from specenv.cost.model import check_drafting, drafting_mode
    from specenv.policy import registry
    from specenv.policy.mlp import MLPPolicy

    folder: Path | None = None
    if registry.is_folder(policy):
        folder = Path(policy)
    elif policy != ORACLE_POLICY and (shipped_policy_dir(traces) / policy / "policy.json").is_file():
        folder = shipped_policy_dir(traces) / policy
    if folder is not None:
        spec = MLPPolicy.load(folder).spec
        if spec.per_token:
            mode, h = "sequential", int(spec.kmax)
        else:
            mode, h = drafting_mode(spec.lookahead), int(spec.lookahead)
        if spec.kmax != kmax:
            raise ValueError(f"--policy: {folder} was trained for kmax={spec.kmax}, the environment has kmax={kmax}")
        if drafting is not None and drafting != mode:
            raise ValueError(f"--drafting: {drafting} but the policy {folder} runs in mode {mode}")
        if lookahead is not None and lookahead != h:
            raise ValueError(f"--lookahead: {lookahead} but the policy {folder} reads h={h}")
        if signals is not None and h and tuple(signals) != tuple(spec.signals):
            raise ValueError(f"--signals: {','.join(signals)} but the policy {folder} reads {','.join(spec.signals)}")
        return ExportPolicy(policy, "folder", mode, h, tuple(spec.signals) if h else ("q",), folder, spec.per_token)
    if policy != ORACLE_POLICY:
        try:
            registry.check(policy)
        except ValueError as exc:
            if policy.partition(":")[0] in registry.names():  # a registered name with a bad parameter
                raise ValueError(f"--policy: {exc}") from None
            shipped = sorted(p.parent.name for p in shipped_policy_dir(traces).glob("*/policy.json"))
            raise ValueError(
                f"--policy: {exc}; nor 'oracle' or a policy shipped for this set ({', '.join(shipped) or 'none'})"
            ) from None
    if drafting == "block" and lookahead is None:  # as oracle and train: the block size is never guessed
        raise ValueError("--lookahead: --drafting block needs the block size h in 1..Kmax (e.g. --lookahead 3)")
    try:
        mode, h = check_drafting(drafting, lookahead, kmax)
    except ValueError as exc:
        raise ValueError(f"--lookahead: {exc}" if "lookahead" in str(exc) else f"--drafting: {exc}") from None
    sig: tuple[str, ...] = ("q",)
    if signals is not None:
        from specenv.observation.single import check_signals

        if not h:
            raise ValueError("--signals: the draft signals need a lookahead (--drafting block or sequential)")
        try:
            sig = check_signals(tuple(signals))
        except ValueError as exc:
            raise ValueError(f"--signals: {exc}") from None
    return ExportPolicy(policy, ORACLE_POLICY if policy == ORACLE_POLICY else "registered", mode, h, sig)


def build_policy(plan: ExportPolicy, env: Any) -> Any:
    """The policy object of a plan for the environment ``env`` (its observation contract checked).

    Raises:
        ValueError: One line naming the policy and the problem.
    """
    from specenv.policy import registry
    from specenv.policy.mlp import MLPPolicy

    spec = env.unwrapped.data.spec
    if plan.kind == ORACLE_POLICY:
        return OracleExpert.for_env(env)
    if plan.folder is not None:
        if plan.per_token:
            from policies.learn.stopping import load_stop_rule

            return load_stop_rule(plan.folder, expect=spec)
        return MLPPolicy.load(plan.folder, expect=spec)
    return registry.resolve(plan.name, spec)


# ------------------------------------------------------------------ export
@dataclass
class ExportResult:
    """What :func:`export_minari` wrote.

    Attributes:
        dataset_id: The Minari id.
        path: Its folder.
        episodes: Episodes recorded.
        steps: Steps (rounds) recorded.
        size_mb: Size on disk in MB (Minari's ``dataset_size``).
        speedup_pooled: The episodes' pooled speedup (sum AR cost / sum cost).
        metadata: The ``"specenv"`` metadata block.
    """

    dataset_id: str
    path: Path
    episodes: int
    steps: int
    size_mb: float
    speedup_pooled: float
    metadata: dict[str, Any] = field(default_factory=dict)


def env_kwargs(traces: str, split: str, kmax: int | None, cost_model: str, plan: ExportPolicy) -> dict[str, Any]:
    """The replay environment's constructor arguments (JSON values: Minari stores them in the EnvSpec).

    A trace-set folder is stored as an absolute path, so ``recover_environment()`` works from anywhere.
    """
    from specenv.traces.datasets import find_dataset

    dataset = traces if find_dataset(traces) is not None else str(Path(traces).resolve())
    kw: dict[str, Any] = {"dataset": dataset, "split": split, "cost_model": cost_model}
    if kmax is not None:
        kw["kmax"] = int(kmax)
    kw |= {"lookahead": int(plan.lookahead), "drafting": plan.drafting, "signals": list(plan.signals)}
    return kw


def export_minari(
    traces: str,
    plan: ExportPolicy,
    root: Path,
    ident: str,
    *,
    split: str = "train",
    kmax: int | None = None,
    cost_model: str = "fit-train",
    episodes: int = 1,
    seed: int = 0,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Roll ``plan``'s policy out on every generation of ``split`` and write the episodes as Minari dataset ``ident``.

    Episode r of generation g is reset with seed :func:`specenv.envs.rollout.episode_seeds` ``(seed, g, r)``
    (the benchmark's seeds) and ``options={"generation_id": g}``; Minari keeps both with the episode.

    Args:
        traces: Trace set (registered name or folder).
        plan: The policy (:func:`plan_policy`).
        root: Minari datasets folder (:func:`resolve_root`).
        ident: Dataset id (:func:`dataset_id`).
        split: ``"train"``, ``"test"`` or ``"all"``.
        kmax: Largest budget (default the set's).
        cost_model: The environment's cost model (default ``fit-train``, the benchmark's charge).
        episodes: Episodes per generation.
        seed: Base seed of the episodes.
        overwrite: Replace an existing dataset of the same id that specenv exported.
        progress: Called with (episodes done, total): (0, total) once the environment and the policy
            are built, then after every episode.

    Returns:
        The :class:`ExportResult`.

    Raises:
        FileExistsError: The dataset exists and ``overwrite`` is false.
        ValueError: One line for a bad policy, setting or destination.
    """
    import gymnasium as gym

    import specenv  # noqa: F401  (registers the environments)
    from specenv import __version__
    from specenv.envs.rollout import episode_seeds
    from specenv.io import atomic_dir, remove_stale_temporaries, sha256_file, temp_sibling
    from specenv.traces.datasets import find_dataset, resolve

    minari = _minari()
    from minari.data_collector.episode_buffer import EpisodeBuffer

    check_id(ident)
    dest = check_destination(root, ident, overwrite)
    kwargs = env_kwargs(traces, split, kmax, cost_model, plan)
    env = gym.make(ENV_ID, **kwargs)
    try:
        policy = build_policy(plan, env)
    except BaseException:
        env.close()
        raise
    data = env.unwrapped.data
    gids = np.asarray(data.generation_ids, dtype=np.int64)
    ep_gid = np.repeat(gids, episodes)
    ep_r = np.tile(np.arange(episodes, dtype=np.int64), len(gids))
    seeds = episode_seeds(seed, ep_gid, ep_r)
    created = [p for p in (root, *root.parents) if not os.path.lexists(p)]  # removed again if this fails
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(root / STAGING)  # what a killed export left (its process is gone)
    staging = temp_sibling(root / STAGING)  # .specenv-staging.<pid>.<8 hex>
    staging.mkdir()
    buffers, total_cost, total_ar = [], 0.0, 0.0
    if progress is not None:  # the environment and the policy are built: the episodes start
        progress(0, len(ep_gid))
    try:
        for e, (gid, s) in enumerate(zip(ep_gid.tolist(), seeds.tolist(), strict=True)):
            options = {"generation_id": int(gid)}
            obs, info = env.reset(seed=int(s), options=options)
            policy.reset()
            observations, actions, rewards, terms, truncs = [obs], [], [], [], []
            t, done = 0, False
            while not done:
                k = policy.act_state(gid, t) if getattr(policy, "privileged", False) else policy.act(obs)
                obs, reward, terminated, truncated, info = env.step(int(k))
                observations.append(obs)
                actions.append(int(k))
                rewards.append(float(reward))
                terms.append(bool(terminated))
                truncs.append(bool(truncated))
                t = int(info["t"])
                done = bool(terminated or truncated)
            total_cost += float(info["episode_cost_ms"])
            total_ar += float(info["ar_cost_ms"])
            buffers.append(
                EpisodeBuffer(
                    id=e,
                    seed=int(s),
                    options=options,
                    observations=observations,
                    actions=actions,
                    rewards=rewards,
                    terminations=terms,
                    truncations=truncs,
                )
            )
            if progress is not None:
                progress(e + 1, len(ep_gid))
        ds = find_dataset(traces)
        spec = data.spec
        block = {
            "format": FORMAT,
            "specenv_version": __version__,
            "trace_set": {
                "dataset": kwargs["dataset"],
                "name": str(data.name),
                "id": ds.id if ds else None,
                "manifest_sha256": sha256_file(resolve(traces) / "manifest.json"),
            },
            "split": split,
            "episodes_per_generation": int(episodes),
            "generations": len(gids),
            "seed": int(seed),
            "cost_model": cost_model,
            "kmax": int(data.kmax),
            "drafting": plan.drafting,
            "lookahead": int(plan.lookahead),
            "signals": list(plan.signals),
            "policy": {
                "name": plan.name,
                "kind": plan.kind,
                "files_sha256": plan.files_sha256(),
                "oracle_table_sha256": policy.table_sha256 if plan.kind == ORACLE_POLICY else None,
            },
            "observation_version": int(spec.version),
            "observation": spec.to_json(),
            "speedup_pooled": total_ar / total_cost,
        }
        with minari_root(staging), warnings.catch_warnings():
            # Minari asks for an e-mail and a permalink: none to give offline
            warnings.filterwarnings("ignore", message=r"`(author_email|code_permalink)` is set to None")
            made = minari.create_dataset_from_buffers(
                dataset_id=ident,
                buffer=buffers,
                env=env,
                eval_env=env.spec,
                algorithm_name=f"specenv policy {plan.name} ({plan.kind})",
                author="specenv",
                description=(
                    f"Episodes of policy {plan.name} on the {split} split of trace set {data.name} "
                    f"(drafting {plan.drafting}, h={plan.lookahead}, cost model {cost_model}) in {ENV_ID}"
                ),
                requirements=[f"specenv=={__version__}"],
                data_format=DATA_FORMAT,
            )
            made.storage.update_metadata({METADATA_KEY: block})
            steps, n_eps = int(made.total_steps), int(made.total_episodes)
            size = float(made.storage.get_size())
        built = dataset_path(staging, ident)
        with atomic_dir(dest, replace=overwrite) as tmp:
            os.rename(built / "data", tmp / "data")
        _mark_namespaces(root, ident)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for p in created:  # a failed export leaves no folder it created (innermost first; only empty ones)
            try:
                p.rmdir()
            except OSError:
                break
        raise
    finally:
        env.close()
        shutil.rmtree(staging, ignore_errors=True)
    return ExportResult(ident, dest, n_eps, steps, size, total_ar / total_cost, block)


def _mark_namespaces(root: Path, ident: str) -> None:
    """Minari's namespace markers (``namespace_metadata.json``) at every level of ``ident``'s namespace, if missing."""
    from minari.namespace import NAMESPACE_METADATA_FILENAME

    from specenv.io import atomic_write_json

    parts = ident.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        marker = root.joinpath(*parts[:i], NAMESPACE_METADATA_FILENAME)
        if not marker.exists():
            atomic_write_json(marker, {})


# ------------------------------------------------------------------ reading back
class _NonFinite(ValueError):
    """An episode's observations hold NaN or an infinity (the message names the file and row)."""


def _nonfinite_row(obs: np.ndarray) -> tuple[int, int] | None:
    """The first (row, column) of an observation array that is not finite, else None."""
    bad = ~np.isfinite(obs)
    if not bad.any():
        return None
    row = int(np.flatnonzero(bad.any(axis=tuple(range(1, obs.ndim))))[0]) if obs.ndim > 1 else int(np.argmax(bad))
    col = int(np.flatnonzero(bad[row])[0]) if obs.ndim > 1 else 0
    return row, col


def _episode_file(folder: Path, episode_id: Any) -> str:
    """The stored file of episode ``episode_id`` of the dataset in ``folder`` (its folder if the file is unknown)."""
    where = folder / "data" / str(int(episode_id))  # Minari's arrow storage: one folder per episode id
    files = sorted(f for f in where.iterdir() if f.name != "metadata.json") if where.is_dir() else []
    return str(files[0] if len(files) == 1 else where)


def _dataset_problem(ds: Any, meta: dict[str, Any], obs: list[np.ndarray], act: list[np.ndarray]) -> str | None:
    """Why a dataset's episodes are not what it recorded, or None.

    The episodes read must be as many, with as many steps, as the dataset's metadata says (a missing
    or truncated part otherwise trains on less than was exported), and the trace set it was recorded
    on must still have the manifest it had (a regenerated set replays other rounds).
    """
    n_eps, n_steps = len(act), int(sum(len(a) for a in act))
    if n_eps != int(ds.total_episodes) or n_steps != int(ds.total_steps):
        return (
            f"holds {n_steps} steps in {n_eps} episodes, its metadata records {int(ds.total_steps)} in "
            f"{int(ds.total_episodes)} (a part is missing or damaged: export it again)"
        )
    ts = meta.get("trace_set") if isinstance(meta.get("trace_set"), dict) else {}
    want = ts.get("manifest_sha256")
    if isinstance(want, str) and isinstance(ts.get("dataset"), str):
        from specenv.io import sha256_file
        from specenv.traces.datasets import resolve

        try:
            got = sha256_file(resolve(ts["dataset"]) / "manifest.json")
        except (OSError, ValueError) as exc:
            return f"its trace set {ts['dataset']!r} cannot be read ({exc})"
        if got != want:
            return (
                f"recorded on trace set {ts['dataset']!r} with manifest sha256 {want[:16]}..., which now has "
                f"{got[:16]}... (the set changed since the export: export it again)"
            )
    return None


@dataclass
class OfflineData:
    """A Minari dataset of specenv, checked, with its transitions.

    Attributes:
        dataset_id: The id.
        dataset: The :class:`minari.MinariDataset`.
        meta: Its ``"specenv"`` metadata block.
        env: The recovered environment (:meth:`minari.MinariDataset.recover_environment`).
        spec: The observation contract of that environment (equal to the recorded one).
        observations: (n, dim) float32, the observation before each step.
        actions: (n,) int64 budgets.
        rewards: (n,) float64.
    """

    dataset_id: str
    dataset: Any
    meta: dict[str, Any]
    env: Any
    spec: Any
    observations: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray


def open_dataset(ident: str, root: Path) -> OfflineData:
    """Load dataset ``ident`` from ``root`` and check it against the environment it recovers.

    Raises:
        ValueError: One line: malformed or unknown id, not exported by specenv, not specenv's replay
            environment, an observation contract or space that differs from the recovered
            environment's (or from this code's contract version), an episode that cannot be read.
    """
    from specenv.observation.single import mismatch_json

    minari = _minari()
    try:
        check_id(ident)
    except ValueError as exc:
        raise ValueError(f"--dataset: {exc}") from None
    folder = dataset_path(root, ident)
    if not (folder / "data" / "metadata.json").is_file():
        raise ValueError(f"--dataset: no Minari dataset {ident} in {root} (write one with `specenv export minari`)")
    if not exported_by_specenv(folder):
        raise ValueError(f"--dataset: {ident} in {root} was not exported by specenv (no '{METADATA_KEY}' metadata)")
    with minari_root(root):
        try:
            ds = minari.load_dataset(ident)
        except Exception as exc:  # a damaged dataset: one line naming it
            raise ValueError(f"--dataset: {ident}: Minari cannot read it ({type(exc).__name__}: {exc})") from None
    meta = dict(ds.storage.metadata[METADATA_KEY])
    env_spec = ds.spec.env_spec
    if env_spec is None or env_spec.id != ENV_ID:
        got = None if env_spec is None else env_spec.id
        raise ValueError(f"--dataset: {ident}: recorded in environment {got}, not specenv's {ENV_ID}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Minari's note on the requirements' version
            env = ds.recover_environment()
    except Exception as exc:
        raise ValueError(
            f"--dataset: {ident}: its environment cannot be rebuilt ({type(exc).__name__}: {exc})"
        ) from None
    spec = env.unwrapped.data.spec
    stored = meta.get("observation")
    bad = "no contract recorded" if not isinstance(stored, dict) else mismatch_json(stored, spec.to_json())
    if bad is not None:
        env.close()
        raise ValueError(f"--dataset: {ident}: observation contract differs from its environment's: {bad}")
    if ds.observation_space != env.observation_space or ds.action_space != env.action_space:
        env.close()
        raise ValueError(f"--dataset: {ident}: its observation/action spaces differ from its environment's")
    obs, act, rew = [], [], []
    try:
        for ep in ds.iterate_episodes():
            full = np.asarray(ep.observations, dtype=np.float32)
            bad = _nonfinite_row(full)
            if bad is not None:  # BC would train on it and report NaN weights: one line naming file and row
                env.close()
                row, col = bad
                raise _NonFinite(
                    f"--dataset: {ident}: {_episode_file(folder, ep.id)}: observation row {row} (feature "
                    f"{spec.names[col] if col < len(spec.names) else col!r}) is {full[row, col]}: the dataset is "
                    "damaged (export it again)"
                )
            obs.append(full[:-1])
            act.append(np.asarray(ep.actions, dtype=np.int64))
            rew.append(np.asarray(ep.rewards, dtype=np.float64))
    except _NonFinite as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:  # a missing or damaged episode file: one line naming the dataset
        env.close()
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"--dataset: {ident}: an episode cannot be read ({type(exc).__name__}: {first})") from None
    problem = _dataset_problem(ds, meta, obs, act)
    if problem is not None:
        env.close()
        raise ValueError(f"--dataset: {ident}: {problem}")
    return OfflineData(
        ident,
        ds,
        meta,
        env,
        replace(spec),
        np.concatenate(obs) if obs else np.empty((0, spec.dim), np.float32),
        np.concatenate(act) if act else np.empty(0, np.int64),
        np.concatenate(rew) if rew else np.empty(0),
    )
