"""Option parsing and validation (no SGLang)."""

from __future__ import annotations

import json

import pytest

from sglang_tiered.config import (
    ConfigError,
    TieredConfig,
    cuda_refusal,
    hooked_prefills,
    layered_reads,
    parse_size,
)
from sglang_tiered.integration.metrics import StatsReporter, format_stats, read_stats_files
from sglang_tiered.storage.stats import TierStats


@pytest.mark.parametrize("text,value", [("0", 0), ("1024", 1024), ("2K", 2048), ("1.5M", 1572864), ("3G", 3 << 30),
                                        ("2GB", 2_000_000_000), ("1TiB", 1 << 40), (" 7 kb ", 7000), (5, 5)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1G", "1Q", "1.2.3M"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_host_pool_settings():
    assert TieredConfig(host_size="").host_pool_settings() == {}
    assert TieredConfig(host_size="3x").host_pool_settings() == {"hicache_ratio": 3.0}
    assert TieredConfig(host_size="4G").host_pool_settings() == {"hicache_size": 4}
    for bad in ("1500M", "0.5x", "1x", "twox", "0"):
        with pytest.raises(ConfigError, match="^--tiered-host-size"):
            TieredConfig(host_size=bad).host_pool_settings()


def test_the_probe_flag_offers_what_the_group_format_writes():
    from sglang_tiered.config import PROBE_BITS_CHOICES
    from sglang_tiered.storage import group_file

    assert PROBE_BITS_CHOICES == group_file.PROBE_BITS_CHOICES
    assert TieredConfig().importance_probe_bits == group_file.PROBE_BITS


def test_validate_names_the_flag(tmp_path):
    fresh = TieredConfig(ssd_dir=str(tmp_path / "new" / "dir"))
    fresh.validate()
    fresh.check_page_fits(1000)
    assert (tmp_path / "new" / "dir").is_dir()
    cases = {
        "--tiered-ssd-capacity": TieredConfig(ssd_dir=str(tmp_path), ssd_capacity=0),
        "--tiered-io-threads": TieredConfig(ssd_dir=str(tmp_path), io_threads=0),
        "--tiered-prefetch-threshold": TieredConfig(ssd_dir=str(tmp_path), prefetch_threshold=-1),
        "--tiered-cpu-attention": TieredConfig(ssd_dir=str(tmp_path), cpu_attention="fast"),
        "--tiered-importance-probe-bits": TieredConfig(ssd_dir=str(tmp_path), importance_probe_bits=5),
        "--tiered-importance-repack-memory": TieredConfig(ssd_dir=str(tmp_path), importance_repack_memory="lots"),
        "--tiered-importance-gate": TieredConfig(ssd_dir=str(tmp_path), importance_gate="vote"),
        "--tiered-importance-max-drop": TieredConfig(ssd_dir=str(tmp_path), importance_max_drop=1.5),
    }
    for flag, cfg in cases.items():
        with pytest.raises(ConfigError, match=f"^{flag}"):
            cfg.validate()
    with pytest.raises(ConfigError, match="^--tiered-ssd-capacity: .* smaller than one KV page"):
        TieredConfig(ssd_dir=str(tmp_path), ssd_capacity=100).check_page_fits(1000)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="^--tiered-ssd-dir: cannot create"):
        TieredConfig(ssd_dir=str(blocker / "sub")).validate()


def test_a_gated_load_samples_at_least_one_head(tmp_path):
    assert TieredConfig().importance_heads == 3
    TieredConfig(ssd_dir=str(tmp_path), importance_heads=1, importance_load="gated").validate()
    with pytest.raises(ConfigError, match="^--tiered-importance-heads: must be >= 1"):
        TieredConfig(ssd_dir=str(tmp_path), importance_heads=0).validate()


def test_an_unusable_ssd_dir_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="/proc is not writable"):  # procfs takes no new file, not even root's
        TieredConfig(ssd_dir="/proc").validate()
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):  # (a path under a file: test_validate_names_the_flag)
        TieredConfig(ssd_dir=str(plain)).validate()


def test_config_json_round_trip_rejects_unknown():
    cfg = TieredConfig(ssd_capacity=123, namespace="x")
    assert TieredConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ConfigError, match="unknown"):
        TieredConfig.from_dict({"bogus": 1})


def test_stats_reporter_writes_json(tmp_path):
    stats = TierStats()
    extra = {"n": 0}
    rep = StatsReporter(stats, json_path=tmp_path / "stats" / "ns.json", page_size=64, capacity_bytes=10,
                        tp_rank=0, describe=lambda: {"id": "ns", "tp_rank": 0}, prometheus=False, log_interval=0,
                        tick=0.05, extras=lambda: {"extra": dict(extra)})
    stats.add(hit_pages=3, bytes_read=300, repacked_groups=2, repacked_pages=9, repack_pages_kept=6,
              repack_pages_read=3, repack_bytes_read=3 << 20, sparse_bytes_read=3 << 20, sparse_bytes_needed=2 << 20)
    extra.update(n=2)
    rep.stop()
    rows = read_stats_files(str(tmp_path))
    assert len(rows) == 1 and rows[0]["hit_pages"] == 3 and rows[0]["hit_tokens"] == 192
    assert rows[0]["extra"] == {"n": 2}  # the extras as they were at the last write
    assert "hits=3 pages (192 tokens" in format_stats(rows[0], 64)
    line = format_stats(rows[0], 64)
    assert "repacked=2 groups (9 pages: 6 from memory, 3 read back, 3.0 MiB)" in line
    assert "read 3.0 MiB for 2.0 MiB used (read amplification 1.50)" in line


def test_every_flag_has_help_and_a_row_in_the_configuration_reference():
    """Each option is flag `--tiered-<field>` with help text and a row in docs/configuration.md (the README lists
    the ones an operator usually sets)."""
    from dataclasses import fields
    from pathlib import Path

    from sglang_tiered.config import FLAG_HELP

    reference = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for f in fields(TieredConfig):
        flag = "--tiered-" + f.name.replace("_", "-")
        assert FLAG_HELP.get(f.name), flag
        assert f"| `{flag}`" in reference or f"| `{flag} " in reference, flag


@pytest.mark.parametrize("fields, backend, preview, refused", [
    ({}, "triton", False, None),  # the store, placement and blend: served
    ({"kvpr": "auto"}, "triton", False, None),  # (registers nothing there without the preview)
    ({"kvpr": "force"}, "triton", False, "--tiered-kvpr force: on a CUDA server it served exactly"),
    ({"kvpr": "force"}, "triton", True, None),
    ({"importance_load": "gated"}, "torch_native", False, "--tiered-importance-load gated: on a CUDA server"),
    ({"importance_load": "gated"}, "triton", True, "needs --attention-backend torch_native"),
    ({"importance_load": "gated", "kvpr": "force"}, "torch_native", True, None),
    ({"runahead_ranks": 2}, "triton", True, "CPU ranks only"),
])
def test_what_a_cuda_server_refuses(tmp_path, fields, backend, preview, refused):
    cfg = TieredConfig(ssd_dir=str(tmp_path), **fields)
    reason = cuda_refusal(cfg, backend, preview)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason
        assert preview or "SGLANG_TIERED_CUDA_PREVIEW=1" in reason or "CPU ranks" in reason


@pytest.mark.parametrize("fields, preview, hooked", [
    ({}, False, ["--tiered-blend blend"]),  # blending computes marked prompts' prefills in the hook
    ({"blend": "prefix"}, False, []),  # SGLang's own prefill
    ({"blend": "off"}, False, []),
    ({"blend": "off", "kvpr": "auto"}, False, []),  # registers nothing on CUDA without the preview
    ({"blend": "off", "kvpr": "force"}, True, ["--tiered-kvpr force"]),
    ({"blend": "full", "importance_load": "gated"}, True, ["--tiered-blend full", "--tiered-importance-load gated",
                                                           "--tiered-kvpr auto"]),
])
def test_which_mechanisms_compute_prefills_in_the_hook_on_cuda(tmp_path, fields, preview, hooked):
    assert hooked_prefills(TieredConfig(ssd_dir=str(tmp_path), **fields), preview) == hooked


@pytest.mark.parametrize("fields, graph, refused", [
    ({}, None, None),  # SGLang's default: the launcher turns the prefill graph off
    ({}, "disabled", None),
    ({}, "breakable", "--cuda-graph-backend-prefill: breakable replays prefills past the forward that --tiered-blend"),
    ({}, "full", "use --cuda-graph-backend-prefill disabled (decode graphs stay) or turn --tiered-blend off"),
    ({"blend": "off"}, "breakable", None),  # nothing of ours computes a prefill
])
def test_a_cuda_prefill_graph_chosen_by_the_operator_is_refused_where_the_hook_computes_prefills(
        tmp_path, fields, graph, refused):
    reason = cuda_refusal(TieredConfig(ssd_dir=str(tmp_path), **fields), "triton", False, graph)
    assert reason == refused if refused is None else refused in reason


@pytest.mark.parametrize("fields, preview, layered", [
    ({}, False, []),  # the store and blending read whole pages (any layout)
    ({"kvpr": "force"}, False, []),  # (refused on CUDA without the preview)
    ({"kvpr": "auto"}, True, ["--tiered-kvpr auto"]),
    ({"kvpr": "off", "importance_load": "gated"}, True, ["--tiered-importance-load gated"]),
])
def test_which_mechanisms_read_stored_pages_layer_by_layer_on_cuda(tmp_path, fields, preview, layered):
    assert layered_reads(TieredConfig(ssd_dir=str(tmp_path), **fields), preview) == layered
