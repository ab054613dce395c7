"""Where the engine's data crosses threads and devices on CUDA: a layer fetched on the loader's thread is complete
before a caller on a stream of its own reads it (SGLang runs its forward on one), and chunk KV computed on the
device is kept in host memory and written to the SSD tier. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from sglang_tiered.engine.layer_loader import LayerLoader
from sglang_tiered.storage.chunk_store import ChunkStore, chunk_key
from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.ssd_tier import CHUNK_PREFIX, SSDTier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ELEMENTS = 1 << 20


def test_a_fetched_layer_is_complete_before_the_callers_stream_reads_it():
    dev = torch.device("cuda")

    def fetch(layer: int) -> torch.Tensor:
        out = torch.zeros(ELEMENTS, device=dev)
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU cycles on the fetch's stream before the fill
        return out.fill_(layer + 1)

    caller = torch.cuda.Stream(dev)
    with torch.cuda.stream(caller):
        with LayerLoader(fetch, 3, device=dev) as loads:
            sums = [loads.get(layer).sum() for layer in range(3)]
        got = [s.item() for s in sums]
    assert got == [float((layer + 1) * ELEMENTS) for layer in range(3)]


def test_chunk_kv_from_the_device_is_kept_in_host_memory_and_written_to_ssd(tmp_path):
    ns = Namespace(model="m", dtype="torch.bfloat16", page_size=0, layout="chunk", layer_num=3, kv_heads=2, head_dim=4)
    ssd = SSDTier(tmp_path, ns, 1 << 20)
    store = ChunkStore(layers=3, kv_heads=2, head_dim=4, dtype=torch.bfloat16, memory_bytes=1 << 20, ssd=ssd)
    kv = torch.randn(3, 7, 2, 2, 4, device="cuda", dtype=torch.bfloat16)
    key = chunk_key([1, 2, 3])
    store.put(key, kv)
    store.flush()
    assert store.layer(key, 0, 7).device.type == "cpu"
    assert ssd.contains(CHUNK_PREFIX + key)
    cold = ChunkStore(layers=3, kv_heads=2, head_dim=4, dtype=torch.bfloat16, memory_bytes=1 << 20, ssd=ssd)
    for layer in range(3):  # read back from the SSD tier, not memory
        torch.testing.assert_close(cold.layer(key, layer, 7), kv[layer].cpu(), rtol=0, atol=0)
    assert cold.hits["ssd"] == 1
    store.close()
    cold.close()
