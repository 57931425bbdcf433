"""kvwire.vllm's registration of vLLM 0.33.0's own KV cache tensors, in this process: for every
KVCacheLayout vLLM's allocator lays out for a plain attention model, the kvwire regions the
connector registers must cover exactly the bytes of each block (item b of every region = block b
of every layer, nothing of any other block), since kvwire moves items, not tensors."""

from __future__ import annotations

import ctypes

import pytest

import vllm_common as vc


@pytest.fixture(scope="module")
def kv():
    return vc.require_vllm()


def _caches(layout_name: str):
    import torch
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    cfg = vc.vllm_config("kv_consumer", vc.free_port(), layout=layout_name)
    specs = {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=vc.BLOCK_SIZE, num_kv_heads=vc.KV_HEADS, head_size=vc.HEAD_SIZE, dtype=torch.float32)
        for i in range(vc.LAYERS)
    }
    lay = resolve_kv_cache_layout(cfg, [[layout_name]], list(specs.values()))
    groups = get_global_kv_cache_groups(cfg, [specs])
    page = vc.BLOCK_SIZE * vc.KV_HEADS * vc.HEAD_SIZE * 2 * 4
    (kcc,) = get_kv_cache_configs(cfg, [specs], [20 * page * vc.LAYERS], groups)
    return allocate_kv_cache(kcc, torch.device("cpu"), lay), kcc.num_blocks


def _read(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)


@pytest.mark.parametrize("layout_name", ["LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC"])
def test_regions_cover_exactly_each_block(kv, layout_name):
    caches, num_blocks = _caches(layout_name)
    layout = kv.describe_kv_caches(caches, num_blocks)
    names = sorted(caches)
    for b in range(num_blocks):  # every block of every layer: a value of its own
        for li, n in enumerate(names):
            caches[n][b].fill_(float(1000 * b + li + 1))
    want_bytes = sum(caches[n][0].numel() * caches[n].element_size() for n in names)
    assert sum(r.item for r in layout.regions) == want_bytes, layout.regions
    for b in range(num_blocks):
        got = b"".join(_read(r.ptr + b * r.item, r.item) for r in layout.regions)
        import numpy as np

        vals = set(np.frombuffer(got, np.float32).tolist())
        assert vals == {float(1000 * b + li + 1) for li in range(len(names))}, (layout_name, b, sorted(vals)[:5])
    assert all(r.nbytes == r.item * num_blocks for r in layout.regions)


def test_a_layout_whose_blocks_are_not_contiguous_is_refused(kv):
    """LHBNC puts a layer's heads outside its blocks: a block is not one run of bytes, and the
    connector refuses to start rather than move partial blocks."""
    caches, num_blocks = _caches("LHBNC")
    with pytest.raises(kv.UnsupportedLayout, match="not contiguous"):
        kv.describe_kv_caches(caches, num_blocks)


def test_split_kv_registers_two_regions_per_layer(kv):
    """The split shape [2, B, N, H, D] (separate K and V): two regions per layer, block b of
    each holding exactly that block's K or V."""
    import numpy as np
    import torch

    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 8, vc.BLOCK_SIZE, vc.KV_HEADS, vc.HEAD_SIZE)
              for i in range(vc.LAYERS)}
    layout = kv.describe_kv_caches(caches, 8)
    assert layout.kind == "split" and len(layout.regions) == 2 * vc.LAYERS
    for li, t in enumerate(caches.values()):
        for b in range(8):
            t[0, b].fill_(float(100 * b + 10 * li + 1))
            t[1, b].fill_(float(100 * b + 10 * li + 2))
    for b in range(8):
        vals = set()
        for r in layout.regions:
            vals |= set(np.frombuffer(_read(r.ptr + b * r.item, r.item), np.float32).tolist())
        assert vals == {float(100 * b + 10 * li + kv_) for li in range(vc.LAYERS) for kv_ in (1, 2)}
