"""Writing an extend's KV into SGLang's own KV pool (`model_forward.store_rows`), in process, no server: the
run-by-run slice copies leave every byte of every layer as the pool's `set_kv_buffer` leaves it, for the slot orders
a paged allocator hands out; pools or inputs the copies do not cover go through `set_kv_buffer`."""

from __future__ import annotations

import pytest
import torch

from sglang_tiered.integration.model_forward import slot_runs, store_rows

pytestmark = pytest.mark.sglang

PAGE, PAGES, LAYERS, HEADS, DIM = 16, 12, 3, 2, 8


def pool(cls=None, dtype=torch.bfloat16):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return (cls or MHATokenToKVPool)(size=PAGES * PAGE, page_size=PAGE, dtype=dtype, head_num=HEADS, head_dim=DIM,
                                     layer_num=LAYERS, device="cpu", enable_memory_saver=False)


def reference(new_kv: torch.Tensor, slots: torch.Tensor, dtype=torch.bfloat16):
    """The same rows written by SGLang's `set_kv_buffer`, layer by layer."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    ref = pool(dtype=dtype)
    for layer in range(LAYERS):
        ref.set_kv_buffer(None, KVWriteLoc(slots, physical=True), new_kv[layer, :, 0], new_kv[layer, :, 1],
                          layer_id_override=layer)
    return ref


def same_buffers(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.k_buffer + a.v_buffer, b.k_buffer + b.v_buffer))


def slots_of(pages: list[int], tokens: int) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)).flatten()[:tokens]


CASES = {  # slots as an allocator hands them out, and the runs they make
    "one run": (slots_of([2, 3, 4, 5], 4 * PAGE), 1),
    "pages scattered, last one partial": (slots_of([7, 1, 4, 9, 3], 4 * PAGE + 5), 5),
    "adjacent pages join": (slots_of([5, 6, 1, 2, 3], 5 * PAGE), 2),
    "every slot its own run": (torch.randperm(PAGES * PAGE, generator=torch.Generator().manual_seed(0))[:50], None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_slice_copies_write_what_set_kv_buffer_writes(case):
    slots, runs = CASES[case]
    new_kv = torch.randn(LAYERS, slots.numel(), 2, HEADS, DIM).to(torch.bfloat16)
    got = pool()
    found = slot_runs(got, slots, new_kv)
    assert found is not None
    if runs is not None:
        assert len(found) == runs
    assert sum(b - a for _, a, b in found) == slots.numel()
    store_rows(got, slots, new_kv)
    assert same_buffers(got, reference(new_kv, slots))
    assert any(x.abs().sum() > 0 for x in got.k_buffer)  # (something was written)


def test_what_the_copies_do_not_cover_goes_through_set_kv_buffer():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    class Relaid(MHATokenToKVPool):  # a subclass may lay rows out otherwise
        pass

    slots = slots_of([3, 1], 2 * PAGE)
    bf16 = torch.randn(LAYERS, slots.numel(), 2, HEADS, DIM).to(torch.bfloat16)
    assert slot_runs(pool(Relaid), slots, bf16) is None
    fp32 = bf16.float() + 1e-3  # another dtype: set_kv_buffer converts it
    plain = pool()
    assert slot_runs(plain, slots, fp32) is None
    store_rows(plain, slots, fp32)
    assert same_buffers(plain, reference(fp32, slots))
    outside = slots.clone()
    outside[-1] = PAGES * PAGE + PAGE  # past the pool's last slot (its padding page included)
    assert slot_runs(plain, outside, bf16) is None
    assert slot_runs(plain, slots[:-1], bf16) is None  # rows and slots disagree
