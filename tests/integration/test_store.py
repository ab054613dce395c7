"""The store's guarantees in live servers: one disk budget for every file, tenant isolation of every stored object,
and per-request retention.

One SmolLM2 server (fp32; device pool 2048 tokens, host 2x; SSD 64M; gated sparse loading and blending on) serves
every step below while a thread samples its SSD directory's size from outside (`tests/dirsize.py`; activation pages
under the same bound: tests/integration/test_kvpr.py).

1. Chunk KV never crosses tenants: three chunks under cache_salt "A" are computed (3 new chunks), under "B" computed
   again (3 new: nothing of A's found), under "A" again found (0 new); without a salt the second request finds the
   first's chunks (shared, as before). An extra_key separates the same way.
2. Repacked groups never cross tenants: a document stored and repacked under "A" is, after /flush_cache, loaded
   sparsely under "A", and then not at all under "B" (0 cached tokens from every tier, no sparse load).
3. Retention: a prompt pinned with custom_params.tiered_retain, one pinned for a second and an unpinned one of the
   same length, then a flood of other prompts larger than device + host + SSD: the unpinned prompt is gone from
   every tier, the pinned one still hits device or host, the one whose pin expired before the flood is gone from
   device and host. Bad values of tiered_retain get a 400.
4. The bound: no sample of the directory ever exceeded the capacity while SSD hits, sparse loads, chunk reuse and
   pins happened (chunk and group files counted in the stats as they appeared); `sglang-tiered stats` shows the
   bytes of every kind; every file is 0600, every directory 0700.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from sglang_tiered.server_process import ServerProcess, cached_details, metric_total, send_until
from tests.dirsize import Sampler
from tests.integration.helpers import tiered_args
from tests.integration.kvpr_helpers import PAGE

pytestmark = [pytest.mark.server, pytest.mark.slow]

CAPACITY = 64 << 20
DEVICE_TOKENS = 2048
RETAIN_S = 90.0  # the pinned prompt's pin (the flood must end well before it)
EXPIRED_S = 1.0  # the other pin, over before the flood begins


@pytest.fixture(scope="module")
def store_server(tmp_path_factory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("store")
    args = tiered_args(tmp / "ssd", "--dtype", "float32", "--enable-metrics", "--tiered-ssd-capacity", str(CAPACITY),
                       "--tiered-importance-load", "gated", "--tiered-retain-share", "0.9", "--tiered-host-size", "2x",
                       max_tokens=DEVICE_TOKENS)
    with ServerProcess(args, log_path=tmp / "store.log") as s:
        s.ssd = tmp / "ssd"
        s.sampler = Sampler(s.ssd)
        try:
            yield s
        finally:
            s.sampler.stop()


def ask(s: ServerProcess, text: str, *, salt: str | None = None, extra_key: str | None = None, **custom) -> dict:
    payload: dict = {"text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                       "custom_params": custom}}
    if salt is not None:
        payload["cache_salt"] = salt
    if extra_key is not None:
        payload["extra_key"] = extra_key
    status, body = s.request("/generate", payload)
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def docs(essays) -> list[str]:
    """The essays of full length (2800 characters, about 700 tokens)."""
    return [e for e in essays if len(e) >= 2800]


def rid(out: dict) -> str:
    return out["meta_info"]["id"]


def new_chunks(s: ServerProcess, out: dict) -> int:
    """How many chunks the blended request computed afresh (not found in the store)."""
    line = next(line for line in s.log_lines("tiered blend: rid") if f"rid {rid(out)} " in line)
    return int(line.split("(new ")[1].split(")")[0])


def sparse_loaded(s: ServerProcess, out: dict) -> bool:
    return any(f"rid {rid(out)} sparse load" in line for line in s.log_lines("tiered sparse: rid"))


def kind_bytes(s: ServerProcess, kind: str, timeout: float = 10.0) -> int:
    """Bytes of one kind of file in the server's statistics file, once it shows some (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = [json.loads(p.read_text()) for p in s.ssd.glob("stats/*.json")]
        got = sum(r.get("bytes_by_kind", {}).get(kind, 0) for r in rows)
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def wait_for_repack(s: ServerProcess, mark: int, groups: int = 1) -> None:
    deadline = time.monotonic() + 60
    while len(s.log_lines("tiered repack:", since=mark)) < groups and time.monotonic() < deadline:
        time.sleep(0.3)
    assert len(s.log_lines("tiered repack:", since=mark)) >= groups, "never repacked"


def test_chunk_kv_never_crosses_tenants(store_server, docs):
    s = store_server
    chunks = [docs[-1][:900], docs[-2][:900], docs[-3][:900]]
    text = "<|chunk|>".join(chunks) + "<|chunk|>Question: which of these texts mentions money?\nAnswer:"
    assert new_chunks(s, ask(s, text, salt="A")) == 3
    assert new_chunks(s, ask(s, text, salt="B")) == 3  # nothing of A's is found under B
    assert new_chunks(s, ask(s, text, salt="A")) == 0  # A's own chunks are
    assert new_chunks(s, ask(s, text, extra_key="adapter-x")) == 3  # an extra_key (a LoRA adapter) separates too
    assert new_chunks(s, ask(s, text)) == 3
    assert new_chunks(s, ask(s, text)) == 0  # no salt: shared, as before
    assert kind_bytes(s, "chunk") > 0  # chunk KV lives in the one SSD tier


def test_repacked_groups_never_cross_tenants(store_server, docs):
    s = store_server
    doc = docs[-4] + "\n\nQuestion: What is this essay about?\nAnswer:"
    mark = s.log_mark()
    cold = ask(s, doc, salt="A")
    wait_for_repack(s, mark)
    assert kind_bytes(s, "group") > 0
    s.flush_cache()
    own = ask(s, doc, salt="A")
    assert sparse_loaded(s, own), s.log_tail()
    s.flush_cache()
    other = ask(s, doc, salt="B")  # the group is still there (just read), and not B's to read
    assert sum(cached_details(other).values()) == 0 and not sparse_loaded(s, other)
    assert own["output_ids"] and cold["output_ids"]


def test_bad_retention_values_get_a_400(store_server):
    for bad in (-1, "long", 10**9, True):
        status, body = store_server.request("/generate", {"text": "hi", "sampling_params": {
            "max_new_tokens": 1, "custom_params": {"tiered_retain": bad}}})
        assert status == 400 and "tiered_retain" in str(body), (bad, status, body)


def test_a_pinned_prompt_outlives_a_flood_and_an_expired_pin_does_not(store_server, docs):
    """Three prompts of the same length: one pinned for RETAIN_S, one pinned for EXPIRED_S (expired before the flood
    begins), one unpinned; then a flood larger than device + host + SSD. The unpinned prompt is gone from every tier,
    the pinned one still hits device or host, the one whose pin expired is evictable again (gone from device and
    host)."""
    s = store_server
    question = "\n\nQuestion: What is the main claim?\nAnswer:"
    pinned_text, plain_text, expired_text = (docs[i] + question for i in (-5, -6, -7))
    s.flush_cache()
    t0 = time.monotonic()
    expired = ask(s, expired_text, tiered_retain=EXPIRED_S)
    pinned = ask(s, pinned_text, tiered_retain=RETAIN_S)
    plain = ask(s, plain_text, tiered_importance="off")
    prompt = pinned["meta_info"]["prompt_tokens"]
    for other in (plain, expired):
        assert abs(prompt - other["meta_info"]["prompt_tokens"]) < PAGE
    for out in (pinned, expired):
        assert s.log_lines(f"tiered retain: rid {rid(out)} pins")
    time.sleep(max(0.0, t0 + EXPIRED_S + 0.5 - time.monotonic()))  # (the three requests took about that long)
    page_bytes = PAGE * 30 * 2 * 3 * 64 * 4  # SmolLM2 in fp32
    flood = DEVICE_TOKENS * 3 + CAPACITY // page_bytes * PAGE + 2 * PAGE  # device + host (2x) + SSD, and then some
    send_until(s, [e + "\n\nSummary:" for e in docs[:-7]], flood)
    assert time.monotonic() - t0 < RETAIN_S - 5, "the flood took longer than the pin lasts; raise RETAIN_S"
    gone = ask(s, plain_text, tiered_importance="off")
    assert sum(cached_details(gone).values()) == 0  # the unpinned prompt left device, host and the SSD
    kept = ask(s, pinned_text, tiered_importance="off")
    details = cached_details(kept)
    assert details["device"] + details["host"] >= prompt // PAGE * PAGE - PAGE, details
    assert kept["output_ids"] == pinned["output_ids"]
    after = cached_details(ask(s, expired_text, tiered_importance="off"))
    assert after["device"] + after["host"] == 0, after  # its pin expired: evictable again


def test_the_directory_never_exceeded_the_capacity(store_server):
    s = store_server
    metrics = s.get("/metrics")
    biggest = s.sampler.stop()
    assert len(s.sampler.samples) > 100 and 0 < biggest <= CAPACITY, (biggest, CAPACITY)
    assert biggest > CAPACITY // 2  # the workload really filled it
    assert metric_total(metrics, "sglang_tiered:ssd_evicted_pages_total") > 0
    assert metric_total(metrics, "sglang_tiered:sparse_requests_total") > 0
    assert metric_total(metrics, "sglang_tiered:retain_pins_total") >= 1
    assert metric_total(metrics, 'sglang:cached_tokens_total') > 0
    out = subprocess.run([sys.executable, "-m", "sglang_tiered.cli", "stats", "--ssd-dir", str(s.ssd)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and " by kind: " in out.stdout, out.stdout + out.stderr
    row = json.loads(subprocess.run([sys.executable, "-m", "sglang_tiered.cli", "stats", "--ssd-dir", str(s.ssd),
                                     "--json"], capture_output=True, text=True, timeout=60).stdout)[0]
    kinds = row["bytes_by_kind"]
    assert kinds["page"] > 0 and kinds["meta"] > 0 and sum(kinds.values()) <= CAPACITY, kinds
    for path in s.ssd.rglob("*"):
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {oct(mode)}"
