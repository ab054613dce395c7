"""Against real SGLang servers on CPU with the embedded SmolLM2: device 2048 tokens, host tier 2x, 64-token pages.

(a) served; (b) evicted from device and host -> SSD hit, identical greedy output; (c) the same after a full restart
(server 1 stopped gracefully right after its last request: that request's pages are all kept; `--dtype auto` is
the dtype server 1 chose and compute-or-load's profile the one it measured, both kept in the SSD directory);
(d) a corrupted page file -> identical output, corrupt counter up; (e) a small capacity -> still serving, the whole
directory within the capacity, the first model's files included (counted as foreign, evicted first); (f) a
different model on the same SSD directory -> nothing served from the first model's pages; (g) the same model in
another dtype -> nothing served either; (h) no read-bandwidth profile (the probe fails) -> a load forced to our
loader is SGLang's, counted, identical output. Every server here runs on server 1's SSD directory, one after another.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import pytest

from sglang_tiered.server_process import ServerProcess, cached_details, metric_total, send_until
from sglang_tiered.storage.geometry import KVGeometry
from sglang_tiered.storage.page_file import PAGE_SUFFIX
from tests.integration.helpers import answers, chosen_dtype, flip_middle_byte, tiered_args, wait_for_metric

pytestmark = [pytest.mark.server, pytest.mark.slow]

DEVICE_TOKENS = 2048
A_PAGES = 10  # full 64-token pages of essay A (over 640 tokens): what its SSD hit loads at least
LATE = "A late request. "  # a prefix that gives every page of the text after it other keys


def page_bytes(dtype: str) -> int:
    """Payload of one 64-token SmolLM2 page in `dtype`."""
    return KVGeometry(layers=30, kv_heads=3, head_dim=64, itemsize=4 if dtype == "float32" else 2).page_bytes(64)


def tiered_server(tmp: Path, ssd: Path, name: str, *extra: str, model: str = "smollm2",
                  env: Optional[dict] = None) -> ServerProcess:
    args = tiered_args(ssd, "--tiered-host-size", "2x", *extra, max_tokens=DEVICE_TOKENS)
    return ServerProcess(args, log_path=tmp / f"{name}.log", model_path=model, env=env)


def ssd_stats(ssd: Path, dtype: str = "") -> dict:
    """The stats file of the one namespace in `ssd` (of the namespace in `dtype` if there are several)."""
    stats = [json.loads(p.read_text()) for p in (ssd / "stats").glob("*.json")]
    if dtype:
        stats = [s for s in stats if s["namespace"]["dtype"] == f"torch.{dtype}"]
    assert len(stats) == 1, stats
    return stats[0]


def wait_for_stats(ssd: Path, done: Callable[[dict], bool], timeout: float = 15.0, dtype: str = "") -> dict:
    """The stats file is rewritten once a second while anything changes: poll it until `done(stats)` or timeout."""
    deadline = time.monotonic() + timeout
    while not done(stats := ssd_stats(ssd, dtype)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return stats


def page_files(ssd: Path) -> list[Path]:
    return sorted(ssd.rglob(f"*{PAGE_SUFFIX}"))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, essays):
    """Server 1: serve A and B cold, push both out of device and host, resend A (an SSD hit)."""
    tmp = tmp_path_factory.mktemp("tiers")
    ssd = tmp / "ssd"
    fillers = list(essays[2:])
    with tiered_server(tmp, ssd, "server-1", "--enable-metrics") as server:
        cold_a = server.generate(essays[0])
        cold_b = server.generate(essays[1])
        send_until(server, fillers, DEVICE_TOKENS * 3)
        hit_a = server.generate(essays[0])
        # (both are published once a second: a tick may fall between A's page loads and its answer)
        metrics = wait_for_metric(server, "sglang_tiered:ssd_hit_pages_total", A_PAGES)
        stats = wait_for_stats(ssd, lambda s: s["hit_pages"] >= A_PAGES)
        dtype = chosen_dtype(server)
        ref_a = answers(server, essays[0], dtype)  # SGLang's own answers to A, cold and from its device cache
        late = server.generate(LATE + essays[0])  # then stopped at once, gracefully: its pages must be kept
        profile = server.log_lines("tiered kvpr: profile ")  # compute-or-load's, measured at the warmup
        server.stop(graceful=30)
    return {"tmp": tmp, "ssd": ssd, "cold_a": cold_a, "cold_b": cold_b, "hit_a": hit_a, "metrics": metrics,
            "stats": stats, "dtype": dtype, "late": late, "ref_a": ref_a, "profile": profile}


def test_a_prompt_is_served(first_run):
    cold = first_run["cold_a"]
    assert cold["meta_info"]["prompt_tokens"] > 640 and cold["text"].strip()
    assert sum(cached_details(cold).values()) == 0


def test_b_evicted_prompt_is_an_ssd_hit_with_identical_output(first_run):
    hit, cold = first_run["hit_a"], first_run["cold_a"]
    d = cached_details(hit)
    assert d["storage"] >= 640 and d["device"] == 0 and d["host"] == 0, d
    assert cold["text"] == first_run["ref_a"].cold["text"]
    first_run["ref_a"].check(hit, "b")  # SGLang's own hit's answer (and the cold one where rows round alone)
    s = first_run["stats"]
    assert s["hit_pages"] >= A_PAGES and s["written_pages"] >= 20 and s["corrupt_pages"] == 0


def test_metrics_endpoint_has_tier_counters(first_run):
    text = first_run["metrics"]
    assert metric_total(text, "sglang_tiered:ssd_hit_pages_total") >= A_PAGES
    assert metric_total(text, "sglang_tiered:ssd_written_bytes_total") >= 20 * page_bytes(first_run["dtype"])
    assert metric_total(text, "sglang_tiered:ssd_used_bytes") > 0
    assert "sglang:cached_tokens_total" in text


def test_g_pages_of_another_dtype_are_never_served(first_run, essays):
    """The namespace holds the KV dtype: a server started on the same SSD directory in the other dtype than the one
    `--dtype auto` chose for server 1 serves none of its pages (while server 2 below, same dtype, does). The prompt is
    the first two pages of one server 1 wrote through, and compute-or-load is off: on an AVX2-only CPU `--dtype auto`
    is float32 and this server's bfloat16 is emulated, ~7x the cost of every forward."""
    tmp, ssd = first_run["tmp"], first_run["ssd"]
    other = "float32" if first_run["dtype"] == "bfloat16" else "bfloat16"
    with tiered_server(tmp, ssd, "server-other-dtype", "--dtype", other, "--tiered-kvpr", "off") as server:
        out = server.generate(essays[2][:800])  # about 190 tokens: the first two of its pages, intact
        assert server.log_lines(f"--dtype {other} (explicit)")
        assert out["meta_info"]["prompt_tokens"] > 2 * 64, out["meta_info"]
    assert cached_details(out)["storage"] == 0 and out["text"].strip()
    namespaces = {json.loads(p.read_text())["dtype"] for p in ssd.glob("*/NAMESPACE.json")}
    assert namespaces == {f"torch.{first_run['dtype']}", f"torch.{other}"}, namespaces


def test_c_d_restart_serves_from_ssd_and_corrupt_pages_are_misses(first_run, essays):
    """(c) a full restart serves A from SSD, identical output, with the compute profile server 1 measured (not
    measured again); (d) then every page file is corrupted: B (never sent to this server, so it can only come from
    SSD) is a miss with identical output, and the corrupt counter rises."""
    tmp, ssd = first_run["tmp"], first_run["ssd"]
    with tiered_server(tmp, ssd, "server-2") as server:
        again = server.generate(essays[0])
        d = cached_details(again)
        assert d["storage"] >= 640 and d["device"] == 0, d
        first_run["ref_a"].check(again, "c")
        late = server.generate(LATE + essays[0])  # sent just before server 1's graceful stop
        assert cached_details(late)["storage"] == (late["meta_info"]["prompt_tokens"] - 1) // 64 * 64, late["meta_info"]
        ref_late = answers(server, LATE + essays[0], first_run["dtype"])
        assert first_run["late"]["text"] == ref_late.cold["text"]
        ref_late.check(late, "c, late")
        assert server.log_lines("as measured on this machine at") or server.log_lines("(explicit)")  # dtype kept
        assert first_run["profile"] and "kept in" in first_run["profile"][0]
        assert server.log_lines("not measured again"), server.log_lines("tiered kvpr")  # and the compute profile
        dtype = first_run["dtype"]
        served = (d["storage"] + cached_details(late)["storage"]) // 64  # the stats file lags: wait for both requests
        hits = wait_for_stats(ssd, lambda s: s["hit_pages"] >= served, dtype=dtype)["hit_pages"]
        assert hits == served

        files = page_files(ssd)
        assert len(files) >= 20
        for p in files:  # flip one byte in the middle of every page file
            flip_middle_byte(p)
        out = server.generate(essays[1])
        stats = wait_for_stats(ssd, lambda s: s["corrupt_pages"] >= 1, dtype=dtype)
    assert out["text"] == first_run["cold_b"]["text"]
    assert cached_details(out)["storage"] == 0
    assert stats["corrupt_pages"] >= 1 and stats["hit_pages"] == hits  # no page served after the corruption
    assert not server.log_lines("tiered kvpr: profile ")  # the scheduler never stopped to measure it


def test_e_f_h_other_model_gets_nothing_and_capacity_holds(first_run, essays, other_model_dir):
    """On server 1's directory (the real model's pages, in every dtype the tests above wrote): another model finds
    none of them, and a capacity of twelve pages holds for the whole directory, their files counted and evicted
    first. (h) This server's read-bandwidth probe fails (an injected fault) and its model has no stored profile: a
    load forced to our loader is SGLang's, logged and counted, with the same output."""
    tmp, ssd, dtype = first_run["tmp"], first_run["ssd"], first_run["dtype"]
    real_pages = page_files(ssd)
    assert len(real_pages) >= 10
    capacity = 12 * page_bytes(dtype) + 12 * 512  # twelve pages plus headers
    with tiered_server(tmp, ssd, "server-other", "--tiered-ssd-capacity", str(capacity), "--dtype", dtype,
                       "--enable-metrics", model=str(other_model_dir),
                       env={"SGLANG_TIERED_TEST_FAULTS": "kvpr_probe"}) as server:
        first = server.generate(essays[0])
        assert cached_details(first)["storage"] == 0  # (f) same tokens, same page keys, other model: not served
        pages = first["meta_info"]["prompt_tokens"] // 64
        wait_for_metric(server, "sglang_tiered:ssd_written_bytes_total", pages * page_bytes(dtype))
        server.flush_cache()
        status, forced = server.request("/generate", {"text": essays[0], "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "custom_params": {"tiered_kvpr": "force"}}})
        assert status == 200 and cached_details(forced)["storage"] >= 2 * 64  # SGLang's load
        ref = answers(server, essays[0], dtype)  # (its pages, written through, may push the first's out: after)
        ref.check(first, "f")
        ref.check(forced, "h")
        assert metric_total(server.get("/metrics"), "sglang_tiered:kvpr_fallbacks_total") == 1
        probe = server.log_lines("cannot measure the SSD read bandwidth (injected fault in kvpr_probe")
        assert probe and "compute-or-load stays off" in probe[0], probe
        assert server.log_lines("runs a normal prefill (no measured profile")
        for text in essays[1:4]:  # (e) about 2000 tokens = 30+ pages through a 12-page tier
            assert server.generate(text, max_new_tokens=1)["text"] is not None
        ref.check(server.generate(essays[0]), "e")
    other_ns = {p.parent.parent for p in page_files(ssd)} - {p.parent.parent for p in real_pages}
    assert len(other_ns) == 1
    used = sum(p.stat().st_size for p in ssd.rglob("*") if p.is_file())  # every file under the directory
    assert 0 < used <= capacity
    assert not any(p.exists() for p in real_pages)  # they counted too, and went first: this server cannot use them
