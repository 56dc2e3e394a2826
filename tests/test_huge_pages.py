"""kernels/huge_pages.py: tensors a decode step streams through, in memory Linux may back with 2 MiB pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixrt.kernels import huge_pages


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address."""
    entry: dict[str, str] = {}
    mine = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            mine = lo <= address < hi
        elif mine:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


def test_an_arena_holds_copies_side_by_side_each_on_a_cache_line():
    tensors = [torch.arange(5, dtype=torch.int8), torch.randn(3, 7).half(), torch.randn(2, 2, 3), torch.empty(0)]
    arena = huge_pages.Arena([t.numel() * t.element_size() for t in tensors])
    copies = [arena.take(t) for t in tensors]
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.is_contiguous() and c.data_ptr() % huge_pages.ALIGN == 0
    assert copies[1].data_ptr() - copies[0].data_ptr() == 64 and copies[2].data_ptr() - copies[1].data_ptr() == 64
    arena = huge_pages.Arena([64])
    arena.take(torch.zeros(16))
    with pytest.raises(ValueError, match="the arena holds 64 bytes; 64 are taken, and 4 more do not fit"):
        arena.take(torch.zeros(1))


def test_large_memory_is_asked_for_in_huge_pages_where_linux_offers_them(monkeypatch):
    """A mapping of 2 MiB or more starts on a 2 MiB boundary, and Linux marks it eligible for huge pages
    (smaps' THPeligible, where the kernel reports it); with RADIXRT_HUGE_PAGES=0, or under 2 MiB, it is
    torch.empty's. Writes reach the memory a view reads."""
    if not huge_pages.available():
        pytest.skip(f"transparent huge pages are not offered to madvise here ({huge_pages.THP} or {huge_pages.ENV})")
    pool = huge_pages.huge_empty(3 * huge_pages.HUGE_PAGE).view(torch.float16).view(3, -1)
    assert pool.data_ptr() % huge_pages.HUGE_PAGE == 0 and pool.shape == (3, huge_pages.HUGE_PAGE // 2)
    pool[2, -1] = 7
    assert pool.view(-1)[-1].item() == 7
    smaps = _smaps_entry(pool.data_ptr())
    if "THPeligible" in smaps:
        assert smaps["THPeligible"] == "1"
    assert huge_pages.huge_empty(1000).numel() == 1000
    huge_pages.available.cache_clear()
    monkeypatch.setenv(huge_pages.ENV, "0")
    try:
        assert not huge_pages.available()
        plain = _smaps_entry(huge_pages.huge_empty(huge_pages.HUGE_PAGE).data_ptr())
        if "[madvise]" in huge_pages.THP.read_text() and "THPeligible" in plain:  # only what asks is eligible
            assert plain["THPeligible"] == "0"
    finally:
        huge_pages.available.cache_clear()
