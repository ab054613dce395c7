"""The shared tier against a real `mooncake_master` on 127.0.0.1 (started and stopped here) and real SGLang servers
(CPU, the embedded SmolLM2), each with its own SSD directory.

In order, on one master: (1) A and B start while the master is down: a warning each, and they serve from their
local tiers; (2) the master starts, both connect by themselves, and a prompt prefilled on A is served on B from the
shared tier (storage tokens, identical greedy output); a prompt A prefilled under cache_salt "t1" is served on B
under "t1", never under "t2"; (3) A's objects in the store are overwritten with corrupt bytes: B counts corrupt
misses and answers identically; (4) the master is killed: A and B keep answering correctly, and reconnect when it is
back.

Another model never sees these objects, and no server of another model is started here to show it: every object is
named by the namespace id of the SSD tier (step 3 finds A's objects under `sgt/<namespace id>/<page key>`), another
model gets another namespace id (test_server_tiers, (f)), and a client of another namespace finds nothing under the
same page keys on a real Mooncake master (tests/unit/test_remote_tier.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sglang_tiered.policy.cpu_dtype import choose_dtype
from sglang_tiered.server_process import ServerProcess, cached_details, metric_total, start_all
from sglang_tiered.storage.page_file import PAGE_SUFFIX
from tests.integration.helpers import answers, tiered_args, wait_for_metric

pytestmark = [pytest.mark.server, pytest.mark.slow]

PUBLISHED = "sglang_tiered:remote_published_pages_total"
REMOTE_HITS = "sglang_tiered:remote_hit_pages_total"
CORRUPT = "sglang_tiered:remote_corrupt_pages_total"
UP = "sglang_tiered:remote_up"


def remote_server(tmp: Path, name: str, master, *extra: str) -> ServerProcess:
    args = tiered_args(tmp / f"ssd-{name}", *master.server_args(), "--tiered-remote-segment", "64M",
                       "--tiered-host-size", "2x", "--enable-metrics", *extra, max_tokens=2048)
    return ServerProcess(args, log_path=tmp / f"{name}.log")


def page_keys(ssd: Path) -> list[tuple[str, str]]:
    """(namespace id, page key) of every page file under an SSD directory."""
    return [(p.parent.parent.name, p.name[: -len(PAGE_SUFFIX)]) for p in ssd.rglob(f"*{PAGE_SUFFIX}")]


def salted(s: ServerProcess, text: str, salt: str) -> dict:
    status, out = s.request("/generate", {"text": text, "cache_salt": salt,
                                          "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert status == 200, out
    return out


def published(server: ServerProcess, at_least: float, quiet_s: float = 2.5, timeout: float = 30.0) -> float:
    """`server`'s published-pages counter once it reached `at_least` and stood still for `quiet_s` seconds (its
    publisher done with what was queued, other prompts' pages included; the counter is reported once a second)."""
    deadline = time.monotonic() + timeout
    last, since = metric_total(server.get("/metrics"), PUBLISHED), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = metric_total(server.get("/metrics"), PUBLISHED)
        if now != last:
            last, since = now, time.monotonic()
        elif now >= at_least and time.monotonic() - since >= quiet_s:
            break
    return last


def metrics_of(server: ServerProcess) -> list[str]:
    """The shared tier's metric lines of `server` (for a failure's message)."""
    return [line for line in server.get("/metrics").splitlines() if line.startswith("sglang_tiered:remote")]


def wait_until(cond, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.25)
    return cond()


def test_servers_share_one_store(tmp_path, essays, model_dir):
    pytest.importorskip("mooncake.store", reason="Mooncake is installed by scripts/setup.sh")
    from mooncake.store import MooncakeDistributedStore

    from sglang_tiered.mooncake_master import MooncakeMaster

    master = MooncakeMaster(tmp_path / "master.log")
    doc, doc2, doc3, doc5 = essays[0], essays[1], essays[2], essays[4]
    dtype = choose_dtype(json.loads((model_dir / "config.json").read_text())).dtype  # one dtype for all
    a = remote_server(tmp_path, "a", master, "--dtype", dtype)
    b = remote_server(tmp_path, "b", master, "--dtype", dtype)
    servers = [a, b]  # (SGLang keeps 10 GiB of host memory free for itself: two at once fit)
    try:
        # (1) A and B start with the master down: local tiers only, and they say so (the master's ports are chosen
        # now; nothing listens on them yet)
        start_all([a, b])
        for s in (a, b):
            assert s.log_lines("tiered remote: cannot connect"), s.log_tail()
        assert a.generate(doc3, max_new_tokens=1)["text"] is not None
        # (2) the master comes up: they connect by themselves; a prompt prefilled on A is served on B from the store
        master.start()
        for s in (a, b):
            assert wait_until(lambda s=s: metric_total(s.get("/metrics"), UP) == 1), f"{s.log_path} did not connect"
        cold = a.generate(doc)
        assert published(a, 10) >= 10, metrics_of(a)
        shared = b.generate(doc)
        d = cached_details(shared)
        assert d["storage"] >= 640 and d["device"] == 0, (b.log_lines("tiered remote:"), d, metrics_of(b),
                                                           b.log_lines("prefetch"))
        ref = answers(a, doc, dtype)  # SGLang's own answers to doc, cold and from its device cache (tests/rounding.py)
        ref.check(cold, "cold on A")
        ref.check(shared, "B from the shared tier")
        assert metric_total(wait_for_metric(b, REMOTE_HITS, 10), REMOTE_HITS) >= 10
        ref.check(b.generate(doc), "B from its own tiers")
        # a tenant's objects are shared with that tenant only: SGLang's seed (cache_salt) names every object
        before = published(a, 0)  # (answers() above prefilled doc on A under fresh salts: those pages go out first)
        tenant = salted(a, doc5, "t1")
        assert published(a, before + 10) >= before + 10, (before, metrics_of(a))
        hits = metric_total(b.get("/metrics"), REMOTE_HITS)
        stranger = salted(b, doc5, "t2")
        assert sum(cached_details(stranger).values()) == 0 and metric_total(b.get("/metrics"), REMOTE_HITS) == hits
        same = salted(b, doc5, "t1")
        assert cached_details(same)["storage"] >= 640, (b.log_lines("tiered remote:"), cached_details(same),
                                                         metrics_of(b), b.log_lines("prefetch"))
        ref5 = answers(a, doc5, dtype)
        ref5.check(tenant, "t1 on A")
        ref5.check(same, "t1 on B")

        # (3) corrupt objects in the store are counted misses; B's answer is what A computed
        before = published(a, 0)
        cold2 = a.generate(doc2)
        assert published(a, before + 10) >= before + 10, (before, metrics_of(a))
        client = MooncakeDistributedStore()
        assert client.setup("127.0.0.1", master.metadata_url, 16 << 20, 16 << 20, "tcp", "",
                            f"127.0.0.1:{master.rpc_port}") == 0
        try:
            corrupted = 0
            for ns_id, key in page_keys(tmp_path / "ssd-a"):  # (the pages A computed offline were never published)
                blob = bytearray(client.get(f"sgt/{ns_id}/{key}"))
                if blob:
                    blob[len(blob) // 2] ^= 0xFF
                    assert client.upsert(f"sgt/{ns_id}/{key}", bytes(blob)) == 0
                    corrupted += 1
            assert corrupted >= 20  # the two prompts A prefilled while the master was up
        finally:
            client.close()
        served = b.generate(doc2)
        assert served["text"] == cold2["text"] and cached_details(served)["storage"] == 0
        assert metric_total(wait_for_metric(b, CORRUPT, 1), CORRUPT) >= 1

        # (4) the master dies: both keep answering correctly from their local tiers and by computing
        master.stop()
        ref3 = answers(a, doc3, dtype)
        ref3.check(a.generate(doc3), "doc3 on A")
        ref3.check(b.generate(doc3), "doc3 on B")
        ref.check(b.generate(doc), "doc on B")
        ref2 = answers(a, doc2, dtype)
        ref2.check(cold2, "doc2 cold on A")
        ref2.check(a.generate(doc2), "doc2 on A")
        assert wait_until(lambda: metric_total(b.get("/metrics"), UP) == 0), "B did not notice the master is gone"
        master.start()
        assert wait_until(lambda: metric_total(a.get("/metrics"), UP) == 1 and metric_total(b.get("/metrics"), UP) == 1,
                          timeout=60), "A and B did not reconnect"
    finally:
        for s in servers:
            s.stop()
        master.stop()
