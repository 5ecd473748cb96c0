"""CPU tensors on 2 MB transparent huge pages, where Linux lets a process ask for them.

A tensor gets a private anonymous mapping of its own, 2 MB aligned and advised MADV_HUGEPAGE
before anything touches it: THP's "madvise" mode (the usual default) then backs it with huge
pages, "always" would anyway, "never" gives plain pages. Elsewhere (no MADV_HUGEPAGE) plain
torch tensors. Mappings stay alive as long as the tensors viewing them.

Why: memory read in a pattern the TLB cannot cover. The KV cache's blocks lie anywhere in
gigabytes of cache (kv_cache.py); a batch-1 decode step streams every weight once, hundreds of
MB, where 4 KB pages cost a TLB miss every 4 KB. SmolLM2's skinny weights in one arena on huge
pages took a batch-1 step from 8.3-10.3 to 6.4-6.5 ms on this project's 2-core EPYC
(alternating processes).
"""
from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes between tensors in an arena: a cache line, and every dtype's alignment


def _huge_region(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of `nbytes` starting on a 2 MB boundary, advised MADV_HUGEPAGE, untouched."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, in a mapping of its own on huge pages."""
    region = _huge_region(math.prod(shape) * dtype.itemsize)
    if region is None:
        return torch.zeros(shape, dtype=dtype)
    return region.view(dtype).view(shape).zero_()  # fresh pages are zero already: this commits them now


class Arena:
    """Contiguous CPU tensors copied one after another into one huge-page mapping of `nbytes`
    (at least the sum of their sizes, each rounded up to ALIGN): many tensors of a few MB
    each would not fill a 2 MB page of their own."""

    def __init__(self, nbytes: int) -> None:
        self.region = _huge_region(nbytes)
        self.used = 0

    @staticmethod
    def size_of(tensors: list[torch.Tensor]) -> int:
        return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of contiguous `t` in the arena (a plain clone where there are no huge pages)."""
        if self.region is None:
            return t.clone()
        nbytes = t.numel() * t.element_size()
        if not t.is_contiguous() or self.used + nbytes > self.region.numel():
            raise ValueError(f"the arena cannot hold a {tuple(t.shape)} {t.dtype} tensor "
                             f"(contiguous: {t.is_contiguous()}, {self.region.numel() - self.used} bytes left)")
        out = self.region[self.used:self.used + nbytes].view(t.dtype).view(t.shape)
        out.copy_(t)
        self.used += -(-nbytes // ALIGN) * ALIGN
        return out
