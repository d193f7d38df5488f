import mmap
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.common.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages
from kvtier.kv import KVCacheConfig
from kvtier.worker.kv_cache import allocate_kv_caches, build_kv_cache_groups

from ..worker.test_kv_cache import model_config

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off here")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def first_huge_page(address: int) -> int:
    return -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES


def test_a_region_without_a_whole_huge_page_is_left_alone():
    buffer = np.zeros(HUGE_PAGE_BYTES, dtype=np.uint8)
    address = first_huge_page(buffer.ctypes.data) + 4096  # no aligned 2 MB fits after it
    assert advise_huge_pages(address, HUGE_PAGE_BYTES - 8192) is False


@needs_thp
def test_the_advice_covers_the_whole_huge_pages_inside():
    mapping = mmap.mmap(-1, 4 * HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    assert advise_huge_pages(address, 4 * HUGE_PAGE_BYTES) is True
    assert "hg" in vm_flags(first_huge_page(address))


@needs_thp
def test_cpu_kv_caches_are_asked_for_on_huge_pages_and_stay_zeroed():
    config = model_config([None, None])
    groups = build_kv_cache_groups(config, block_size=16, dtype_size=4)
    num_blocks = 3 * HUGE_PAGE_BYTES // (2 * 16 * 2 * 8 * 4)  # 6 MB per layer
    caches = allocate_kv_caches(KVCacheConfig(num_blocks, groups),
                                layer_names=config.layer_names, dtype=torch.float32,
                                device=torch.device("cpu"))
    for cache in caches:
        assert "hg" in vm_flags(first_huge_page(cache.data_ptr()))
        assert int(cache.count_nonzero()) == 0
