"""The torch stand-ins for sgl_kernel's host<->device KV copies (integration/cpu_shims.py), against plain indexing.
(The module imports SGLang only inside `apply_in_process`; these functions need torch alone.)"""

from __future__ import annotations

import torch

from sglang_tiered.integration.cpu_shims import (
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_per_layer_direct_pf_lf,
)


def test_page_first_direct_round_trip_matches_indexing():
    torch.manual_seed(0)
    layers, tokens, heads, dim, page, pages = 3, 40, 2, 4, 8, 6
    device_k = [torch.randn(tokens, heads, dim) for _ in range(layers)]
    device_v = [torch.randn(tokens, heads, dim) for _ in range(layers)]
    host_k = torch.zeros(pages, layers, page, heads, dim)
    host_v = torch.zeros_like(host_k)
    src = torch.arange(8, 24)  # two pages' worth of device slots
    dst = torch.cat([torch.arange(5 * page, 6 * page), torch.arange(1 * page, 2 * page)])  # host pages 5 and 1
    transfer_kv_all_layer_direct_lf_pf(device_k + device_v, [host_k, host_v], src, dst, page)
    for layer in range(layers):
        assert torch.equal(host_k[5, layer], device_k[layer][8:16])
        assert torch.equal(host_v[1, layer], device_v[layer][16:24])
    assert host_k[0].abs().sum() == 0  # nothing else written

    back_k, back_v = torch.zeros(tokens, heads, dim), torch.zeros(tokens, heads, dim)
    transfer_kv_per_layer_direct_pf_lf([host_k, host_v], [back_k, back_v], dst, src + 10, 2, page)
    assert torch.equal(back_k[18:34], device_k[2][8:24]) and torch.equal(back_v[18:34], device_v[2][8:24])
    assert back_k[:18].abs().sum() == 0
