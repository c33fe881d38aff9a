"""Transparent huge pages for the engines' weights: the same engine, the same step time, every start.

A target whose experts are far larger than the last-level cache (``wide-moe-v1``: 1.8 GB of float32
experts) makes every verification pass a walk through gigabytes of weights, and with 4 KiB pages that
walk is a TLB-miss storm whose cost depends on where each engine's pages happen to land. Measured on
this 2-core machine (quiet, load ~1; three identical plain engines in one process, interleaved, 4
prompts x 64 tokens x 3 repeats): mean step 23.7 / 21.3 / 19.9 ms with 4 KiB pages, 17.4 / 17.9 /
17.6 ms with the weights on 2 MiB pages; and the collector's controller engine at K = 2 / 4 / 8 was
+14.5% / +13.5% / -8% against a stock engine with ``num_speculative_tokens = K`` with 4 KiB pages,
+1.5% / +0.8% / +1.3% with huge pages. A GPU reads its weights from HBM through large pages; the
replay's cost model, fitted on one engine and charged to others, is only honest when the engines'
memory behaves alike.

Two ways in, for the two kinds of engine specenv starts:

* a child process (``specenv abtest``'s engines, ``specenv serve``'s vLLM, ``scripts/vllm_bench.py``):
  :func:`with_hugepages` adds glibc's ``glibc.malloc.hugetlb=1`` tunable to its environment
  (``GLIBC_TUNABLES``), so malloc advises transparent huge pages for every large allocation;
* an engine in this process (the collector's engines, :class:`~specenv.engines.vllm.live.VLLMBackend`):
  :func:`advise_model` advises (``madvise(MADV_HUGEPAGE)``) and collapses (``MADV_COLLAPSE``, Linux >= 6.1)
  the memory of every parameter after the model is loaded.

Both need the kernel's transparent huge pages in mode ``always`` or ``madvise``
(``/sys/kernel/mm/transparent_hugepage/enabled``); with ``never`` nothing changes, and
:func:`backing` says so in every manifest and A/B document. ``SPECENV_HUGEPAGES=0`` turns both off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: glibc's tunable: malloc advises transparent huge pages for the chunks it maps (glibc >= 2.35).
TUNABLE = "glibc.malloc.hugetlb=1"
#: Set to ``0`` to leave every engine on the kernel's default pages.
OFF_VAR = "SPECENV_HUGEPAGES"
#: The transparent-huge-page mode file of the kernel.
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: Huge page size on x86-64 and arm64 (4 KiB base pages).
HUGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether specenv asks for huge pages (not turned off by ``SPECENV_HUGEPAGES=0``)."""
    env = os.environ if environ is None else environ
    return env.get(OFF_VAR, "1").strip() not in ("0", "false", "no", "off")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``; None if unknown)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def with_hugepages(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with :data:`TUNABLE` in ``GLIBC_TUNABLES`` (kept as is if the user set ``glibc.malloc.hugetlb``)."""
    env = dict(environ)
    if not enabled(env):
        return env
    have = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.split("=", 1)[0] == "glibc.malloc.hugetlb" for t in have):
        env["GLIBC_TUNABLES"] = ":".join([*have, TUNABLE])
    return env


def _spans(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merged ``[start, end)`` spans, each shrunk inward to whole huge pages (empty ones dropped)."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out = []
    for start, end in merged:
        lo = -(-start // HUGE) * HUGE
        hi = end // HUGE * HUGE
        if hi > lo:
            out.append((lo, hi))
    return out


def advise_ranges(ranges: Iterable[tuple[int, int]], collapse: bool = True) -> dict[str, Any]:
    """``madvise(MADV_HUGEPAGE)`` (then ``MADV_COLLAPSE``) over the whole huge pages inside ``ranges``.

    Returns:
        ``bytes`` advised, ``collapsed`` bytes the kernel collapsed now, and ``errors`` (errno names).
    """
    spans = _spans(ranges)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = collapsed = 0
    errors: set[str] = set()
    for lo, hi in spans:
        if libc.madvise(ctypes.c_void_p(lo), hi - lo, MADV_HUGEPAGE) != 0:
            errors.add(os.strerror(ctypes.get_errno()))
            continue
        done += hi - lo
        if collapse:
            if libc.madvise(ctypes.c_void_p(lo), hi - lo, MADV_COLLAPSE) == 0:
                collapsed += hi - lo
            else:
                errors.add(os.strerror(ctypes.get_errno()))
    return {"bytes": done, "collapsed": collapsed, "errors": sorted(errors)}


def advise_model(model: Any) -> dict[str, Any]:
    """Put the CPU parameters and buffers of a torch module on huge pages (see the module docstring)."""
    if not enabled() or thp_mode() in (None, "never"):
        return {"bytes": 0, "collapsed": 0, "errors": [], "skipped": True}
    ranges = []
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "cpu" and t.numel() > 0:
            ptr = t.untyped_storage().data_ptr()
            ranges.append((ptr, ptr + t.untyped_storage().nbytes()))
    return advise_ranges(ranges)


def engine_models(llm: Any) -> list[Any]:
    """The torch modules of an in-process ``vllm.LLM``: its target, and its drafter's model if it has one."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    models = [runner.model]
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and getattr(drafter, "model", None) is not None:
        models.append(drafter.model)
    return models


def advise_engine(llm: Any) -> dict[str, Any]:
    """:func:`advise_model` over every model of an in-process engine (:func:`engine_models`), summed."""
    total: dict[str, Any] = {"bytes": 0, "collapsed": 0, "errors": []}
    for model in engine_models(llm):
        res = advise_model(model)
        total["bytes"] += res["bytes"]
        total["collapsed"] += res["collapsed"]
        total["errors"] = sorted(set(total["errors"]) | set(res["errors"]))
    return total


def process_hugepage_kb(pid: int | str = "self") -> int | None:
    """``AnonHugePages`` of a process in kB (``/proc/PID/smaps_rollup``), None if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def huge_kb_at(address: int, pid: int | str = "self") -> int | None:
    """``AnonHugePages`` (kB) of the mapping of a process that holds ``address`` (None: no such mapping)."""
    inside = False
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, _, hi = head.partition("-")
            try:
                inside = int(lo, 16) <= address < int(hi, 16)
            except ValueError:
                inside = False
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def mapping_path(address: int, pid: int | str = "self") -> str | None:
    """The file a process's mapping holding ``address`` maps ("" for anonymous memory, None: no mapping)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(None, 5)
        lo, _, hi = parts[0].partition("-")
        if int(lo, 16) <= address < int(hi, 16):
            return parts[5].strip() if len(parts) > 5 and not parts[5].startswith("[") else ""
    return None


def backing(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What a manifest or an A/B document records about the engines' pages."""
    env = os.environ if environ is None else environ
    return {
        "thp_mode": thp_mode(),
        "requested": enabled(env),
        "malloc_tunable": TUNABLE in env.get("GLIBC_TUNABLES", "").split(":"),
        "this_process_anon_hugepages_kb": process_hugepage_kb(),
    }
