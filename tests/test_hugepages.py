"""Huge pages for the engines' weights (specenv.engines.vllm.hugepages): environments, spans, madvise."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest

from specenv.engines.vllm import hugepages as hp
from specenv.engines.vllm.bench import engine_env
from specenv.engines.vllm.settings import serve_env

MiB = 1 << 20


def test_tunable_added_kept_and_respected():
    assert hp.with_hugepages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    both = hp.with_hugepages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"]
    assert both == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    # the user's own choice of the same tunable wins
    assert hp.with_hugepages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
    # turned off: the environment is left as it was
    assert "GLIBC_TUNABLES" not in hp.with_hugepages({"SPECENV_HUGEPAGES": "0"})


def test_engine_and_serve_environments_ask_for_huge_pages():
    assert "glibc.malloc.hugetlb=1" in engine_env({})["GLIBC_TUNABLES"].split(":")
    assert "GLIBC_TUNABLES" not in engine_env({"SPECENV_HUGEPAGES": "off"})
    cpu = serve_env({}, [], on_cpu=True, available_bytes=8 << 30)
    assert cpu["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert "GLIBC_TUNABLES" not in serve_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, [], on_cpu=True)
    assert serve_env({}, [], on_cpu=False) == {}  # on a GPU vLLM's defaults are kept


def test_thp_mode_reads_the_bracketed_word(tmp_path: Path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hp.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert hp.thp_mode(f) == "always"
    assert hp.thp_mode(tmp_path / "missing") is None


def test_spans_merge_and_shrink_to_whole_huge_pages():
    H = 2 * MiB
    # two touching ranges merge; the result shrinks inward to huge-page boundaries
    assert hp._spans([(H + 5, 2 * H), (2 * H, 5 * H - 1)]) == [(2 * H, 4 * H)]
    # a range inside one huge page advises nothing; disjoint ranges stay apart
    assert hp._spans([(H + 1, 2 * H - 1)]) == []
    assert hp._spans([(4 * H, 6 * H), (0, 2 * H)]) == [(0, 2 * H), (4 * H, 6 * H)]


def _anon_huge_kb(lo: int, hi: int) -> int:
    """AnonHugePages (kB) of this process's mappings that overlap [lo, hi)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            a, b = int(m.group(1), 16), int(m.group(2), 16)
            inside = a < hi and b > lo
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_advise_ranges_puts_an_anonymous_buffer_on_huge_pages():
    buf = mmap.mmap(-1, 16 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc maps
    buf.write(b"\1" * (16 * MiB))  # touch every page
    import ctypes

    lo = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    res = hp.advise_ranges([(lo, lo + 16 * MiB)])
    # the whole huge pages inside a 16 MiB mapping: 7 or 8 of them, depending on its alignment
    assert res["bytes"] in (14 * MiB, 16 * MiB)
    if hp.thp_mode() in ("always", "madvise"):
        assert res["collapsed"] == res["bytes"], res
        assert _anon_huge_kb(lo, lo + 16 * MiB) * 1024 >= res["bytes"]
        assert hp.huge_kb_at(lo + 8 * MiB) >= 2048  # the mapping holding the middle of the buffer
    assert hp.huge_kb_at(0) is None  # no mapping at address 0
    del lo
    buf.close()
    if hp.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {hp.thp_mode()!r} here: the collapse itself is not checked")


def test_advise_model_covers_the_parameters():
    torch = pytest.importorskip("torch")
    lin = torch.nn.Linear(2048, 2048, bias=False)  # 16 MiB of float32 weights
    res = hp.advise_model(lin)
    if hp.thp_mode() in (None, "never"):
        assert res["skipped"] and res["bytes"] == 0
    else:
        assert res["bytes"] >= 12 * MiB, res  # at most one huge page lost at each end
        assert res["bytes"] <= 16 * MiB


def test_backing_reports_the_mode_and_the_request():
    b = hp.backing({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    assert b["malloc_tunable"] is True and b["requested"] is True
    assert hp.backing({"SPECENV_HUGEPAGES": "0"})["requested"] is False
    assert b["thp_mode"] == hp.thp_mode()
