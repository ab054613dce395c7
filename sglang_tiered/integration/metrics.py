"""Tier statistics out of the scheduler process: Prometheus counters (with `--enable-metrics`), a log line, and a
JSON file per rank at `<ssd dir>/stats/<namespace id>.json` (read by `sglang-tiered stats`).

Prometheus metrics (label `tp_rank`), all prefixed `sglang_tiered:ssd_`:
hit_pages_total, hit_tokens_total, miss_pages_total, read_bytes_total, written_pages_total, written_bytes_total,
evicted_pages_total, corrupt_pages_total, foreign_pages_total, lost_pages_total, io_errors_total,
rejected_pages_total, repacked_groups_total, repacked_pages_total, repack_pages_kept_total (taken from the copy
kept at write), repack_pages_read_total and repack_read_bytes_total (read back from SSD), group_reads_total,
imported_pages_total (counters); used_bytes, capacity_bytes, stored_pages, used_bytes_by_kind{kind} (gauges: every
file under the SSD directory by kind, `storage/disk_index.py`).
Retention (`sglang_tiered:`): pinned_pages{tier="device"|"host"}, pinned_bytes{tier="ssd"} (gauges),
retain_pins_total, retain_released_total (pins released early: the bound was reached), retain_refused_total.
With `--tiered-remote`, the shared tier's, prefixed `sglang_tiered:remote_`: hit_pages_total, miss_pages_total,
read_bytes_total, read_seconds_total, published_pages_total, written_bytes_total, corrupt_pages_total,
foreign_pages_total, dropped_pages_total, errors_total (counters); up (gauge: 1 while the store answers).
Device and host hit tokens are SGLang's own `sglang:cached_tokens_total{source="device"|"host"|"storage"}`.

Counters of the mechanisms (`Events.count`, summed over scheduler processes), when SGLang's metrics are on:
`sglang_tiered:runahead_prefills_total`, `..._runahead_tokens_total`, `..._runahead_fallbacks_total`,
`..._runahead_bytes_sent_total`; `sglang_tiered:blend_requests_total`, `..._blend_reused_tokens_total`,
`..._blend_new_chunks_total`, `..._blend_fallbacks_total`; `sglang_tiered:hook_errors_total` (exceptions inside our
hooks, each answered by SGLang's own code path).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from sglang_tiered.storage.files import write_atomic
from sglang_tiered.storage.stats import TierStats

logger = logging.getLogger("sglang_tiered")

_COUNTERS = {
    "hit_pages": "hit_pages_total",
    "miss_pages": "miss_pages_total",
    "bytes_read": "read_bytes_total",
    "written_pages": "written_pages_total",
    "bytes_written": "written_bytes_total",
    "evicted_pages": "evicted_pages_total",
    "corrupt_pages": "corrupt_pages_total",
    "foreign_pages": "foreign_pages_total",
    "lost_pages": "lost_pages_total",
    "io_errors": "io_errors_total",
    "rejected_pages": "rejected_pages_total",
    "repacked_groups": "repacked_groups_total",
    "repacked_pages": "repacked_pages_total",
    "repack_pages_kept": "repack_pages_kept_total",
    "repack_pages_read": "repack_pages_read_total",
    "repack_bytes_read": "repack_read_bytes_total",
    "group_reads": "group_reads_total",
    "imported_pages": "imported_pages_total",
}
_REMOTE_COUNTERS = {  # sglang_tiered:remote_<name> (with --tiered-remote)
    "remote_hit_pages": "hit_pages_total",
    "remote_miss_pages": "miss_pages_total",
    "remote_bytes_read": "read_bytes_total",
    "remote_read_seconds": "read_seconds_total",
    "remote_published_pages": "published_pages_total",
    "remote_bytes_written": "written_bytes_total",
    "remote_corrupt_pages": "corrupt_pages_total",
    "remote_foreign_pages": "foreign_pages_total",
    "remote_dropped_pages": "dropped_pages_total",
    "remote_errors": "errors_total",
}


def format_stats(s: dict, page_size: int) -> str:
    mib = 1024 * 1024
    extra = ""
    if s.get("repacked_groups"):
        extra += (f" repacked={s['repacked_groups']} groups ({s['repacked_pages']} pages: "
                  f"{s.get('repack_pages_kept', 0)} from memory, {s.get('repack_pages_read', 0)} read back, "
                  f"{s.get('repack_bytes_read', 0) / mib:.1f} MiB), group reads={s.get('group_reads', 0)}")
    if s.get("sparse_bytes_needed"):
        read, needed = s["sparse_bytes_read"], s["sparse_bytes_needed"]
        extra += (f" sparse loads read {read / mib:.1f} MiB for {needed / mib:.1f} MiB used (read amplification "
                  f"{read / needed:.2f})")
    if s.get("remote_published_pages") or s.get("remote_hit_pages") or s.get("remote_errors"):
        extra += (f" remote: hits={s['remote_hit_pages']} pages ({s['remote_bytes_read'] / mib:.1f} MiB) "
                  f"misses={s['remote_miss_pages']} published={s['remote_published_pages']} "
                  f"({s['remote_bytes_written'] / mib:.1f} MiB) corrupt={s['remote_corrupt_pages']} "
                  f"foreign={s['remote_foreign_pages']} dropped={s['remote_dropped_pages']} "
                  f"errors={s['remote_errors']} up={s['remote_up']}")
    kinds = s.get("bytes_by_kind")
    if kinds:
        extra += " by kind: " + ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in kinds.items() if v)
    pins = s.get("retention")
    if pins and pins.get("pins"):
        extra += (f" retention: {pins['pins']} pins over {pins['pages']} pages (device "
                  f"{pins['device_pinned_pages']}, host {pins['host_pinned_pages']} pages, SSD "
                  f"{pins['ssd_pinned_bytes'] / mib:.1f} MiB)")
    return (
        f"hits={s['hit_pages']} pages ({s['hit_pages'] * page_size} tokens, {s['bytes_read'] / mib:.1f} MiB) "
        f"misses={s['miss_pages']} written={s['written_pages']} ({s['bytes_written'] / mib:.1f} MiB) "
        f"used={s['used_bytes'] / mib:.1f} MiB in {s['stored_pages']} pages evicted={s['evicted_pages']} "
        f"corrupt={s['corrupt_pages']} foreign={s['foreign_pages']} lost={s['lost_pages']} "
        f"io_errors={s['io_errors']} rejected={s['rejected_pages']}{extra}"
    )


class StatsReporter:
    """Background thread: every `tick` seconds publishes deltas to Prometheus and the JSON file; every
    `log_interval` seconds (if anything changed) writes one log line. `stop()` publishes a final time."""

    def __init__(
        self,
        stats: TierStats,
        *,
        json_path: Path,
        write_json: Optional[Callable[[bytes], object]] = None,
        page_size: int,
        capacity_bytes: int,
        tp_rank: int,
        describe: Callable[[], dict],
        prometheus: bool,
        log_interval: float,
        tick: float = 1.0,
        extras: Callable[[], dict] = dict,
    ) -> None:
        """`extras()` adds fields to the JSON file (e.g. the bytes by kind and the retention block). `write_json(data)`
        replaces the file (the SSD tier's `meta.write`, which counts its bytes); by default an atomic replace."""
        self.stats = stats
        self.json_path = json_path
        self.write_json = write_json or (lambda data: write_atomic(json_path, data))
        self.page_size = page_size
        self.capacity_bytes = capacity_bytes
        self.describe = describe
        self.extras = extras
        self._last_extras: Optional[dict] = None
        self.log_interval = log_interval
        self.tick = tick
        self._last: dict = stats.snapshot()
        self._last_logged: dict = dict(self._last)
        self._since_log = 0.0
        self._stop = threading.Event()
        self._prom = _PromMetrics(tp_rank) if prometheus else None
        self._thread = threading.Thread(target=self._run, name="tiered-stats", daemon=True)
        self.publish()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.publish()

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                self.publish()
            except Exception:  # statistics must never take the server down
                logger.exception("tiered: publishing statistics failed")

    def publish(self) -> None:
        snap = self.stats.snapshot()
        extras = self.extras()
        if self._prom is not None:
            self._prom.update(self._last, snap, self.page_size, self.capacity_bytes, extras)
        if snap != self._last or not self.json_path.exists() or extras != self._last_extras:
            self._write_json(snap, extras)
        self._last_extras = extras
        self._last = snap
        self._since_log += self.tick
        if self.log_interval > 0 and self._since_log >= self.log_interval and snap != self._last_logged:
            logger.info("tiered ssd: %s", format_stats(snap, self.page_size))
            self._last_logged = snap
            self._since_log = 0.0

    def _write_json(self, snap: dict, extras: dict) -> None:
        payload = {**snap, **extras, "hit_tokens": snap["hit_pages"] * self.page_size,
                   "page_size": self.page_size, "capacity_bytes": self.capacity_bytes, "namespace": self.describe()}
        self.write_json(json.dumps(payload, indent=1, sort_keys=True).encode())


class _PromMetrics:
    def __init__(self, tp_rank: int) -> None:
        from prometheus_client import Counter, Gauge

        self.labels = {"tp_rank": str(tp_rank)}
        names = list(self.labels)
        self.counters = {
            field: Counter(f"sglang_tiered:ssd_{name}", f"SSD tier {field.replace('_', ' ')}", names)
            for field, name in _COUNTERS.items()
        } | {
            field: Counter(f"sglang_tiered:remote_{name}", f"Shared tier {field[7:].replace('_', ' ')}", names)
            for field, name in _REMOTE_COUNTERS.items()
        }
        self.hit_tokens = Counter("sglang_tiered:ssd_hit_tokens_total", "Tokens served from the SSD tier", names)
        gauge = lambda n, d: Gauge(n, d, names, multiprocess_mode="mostrecent")  # noqa: E731
        self.used = gauge("sglang_tiered:ssd_used_bytes", "Bytes used by the SSD tier")
        self.capacity = gauge("sglang_tiered:ssd_capacity_bytes", "Capacity of the SSD tier in bytes")
        self.pages = gauge("sglang_tiered:ssd_stored_pages", "Pages stored in the SSD tier")
        self.remote_up = gauge("sglang_tiered:remote_up", "1 while the shared tier (--tiered-remote) answers")
        labelled = lambda n, d, extra: Gauge(n, d, [*names, extra], multiprocess_mode="mostrecent")  # noqa: E731
        self.by_kind = labelled("sglang_tiered:ssd_used_bytes_by_kind", "Bytes under the SSD directory by kind", "kind")
        self.pinned_pages = labelled("sglang_tiered:pinned_pages", "Pages of unexpired retention pins a tier holds",
                                     "tier")
        self.pinned_bytes = labelled("sglang_tiered:pinned_bytes", "Bytes of unexpired retention pins a tier holds",
                                     "tier")

    def update(self, old: dict, new: dict, page_size: int, capacity: int, extras: dict) -> None:
        for field, counter in self.counters.items():
            delta = new[field] - old[field]
            if delta > 0:
                counter.labels(**self.labels).inc(delta)
        hits = new["hit_pages"] - old["hit_pages"]
        if hits > 0:
            self.hit_tokens.labels(**self.labels).inc(hits * page_size)
        self.used.labels(**self.labels).set(new["used_bytes"])
        self.capacity.labels(**self.labels).set(capacity)
        self.pages.labels(**self.labels).set(new["stored_pages"])
        self.remote_up.labels(**self.labels).set(new["remote_up"])
        for kind, nbytes in extras.get("bytes_by_kind", {}).items():
            self.by_kind.labels(**self.labels, kind=kind).set(nbytes)
        pins = extras.get("retention")
        if pins:
            for tier in ("device", "host"):
                self.pinned_pages.labels(**self.labels, tier=tier).set(pins[f"{tier}_pinned_pages"])
            self.pinned_bytes.labels(**self.labels, tier="ssd").set(pins["ssd_pinned_bytes"])


def read_stats_files(ssd_dir: str) -> list[dict]:
    out = []
    for path in sorted(Path(ssd_dir, "stats").glob("*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def prometheus_enabled(storage_metrics_flag: bool) -> bool:
    return bool(storage_metrics_flag or os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


EVENTS = {
    "runahead_prefills": "Prefills computed by the chain (KV-Runahead)",
    "runahead_tokens": "Prompt tokens prefilled by the chain",
    "runahead_fallbacks": "Long prefills that fell back to SGLang's (chain not running, failed or timed out, or a "
    "request our engine cannot compute)",
    "runahead_bytes_sent": "KV bytes sent between chain ranks",
    "blend_requests": "Requests served by blending stored chunk KV",
    "blend_reused_tokens": "Prompt tokens whose stored chunk KV was reused",
    "blend_new_chunks": "Chunks seen for the first time (standalone KV computed and stored)",
    "blend_fallbacks": "Marked requests that got SGLang's normal prefill",
    "hook_errors": "Exceptions inside sglang-tiered hooks (the batch fell back to SGLang's own code)",
    "repack_offers": "Prompts whose complete pages were offered to the repacker (gated loading)",
    "sparse_requests": "Requests whose stored prefix was loaded sparsely (gated)",
    "sparse_gate_passes": "Layers of sparse loads whose gate passed (only their picks loaded): the sampled "
    "heads agreed (jaccard), or the picks left out at most --tiered-importance-max-drop of the attention (mass)",
    "sparse_gate_fails": "Layers of sparse loads that loaded the whole stored span (the gate failed, or the "
    "probe was skipped)",
    "sparse_attention_dropped": "Share of the window's attention on stored tokens left out, summed over the "
    "passed layers of sparse loads (divided by sparse_gate_passes: the mean per passed layer)",
    "sparse_probes_skipped": "Layers of sparse loads that loaded the whole stored span without reading their "
    "probe (the layer's gate failed on its last --tiered-importance-probe-skip measured loads)",
    "sparse_tokens_skipped": "Token-layers of stored prefixes not loaded by sparse loads",
    "sparse_bytes_skipped": "Bytes of K and V of stored prefixes not loaded by sparse loads (the probe read "
    "instead is in sparse_bytes_read)",
    "sparse_bytes_read": "Bytes read from repacked groups by sparse loads (probe + chunks)",
    "sparse_bytes_needed": "Bytes of the K and V of the stored tokens sparse loads used",
    "sparse_fallbacks": "Gated requests whose stored span SGLang loaded or computed instead",
    "sparse_too_long": "Gated requests longer than --chunked-prefill-size (SGLang loaded their stored prefix)",
    "kvpr_loads": "Stored spans loaded by our compute-or-load loader (front computed, back read)",
    "kvpr_tokens_recomputed": "Tokens of stored spans read as activations, their K and V recomputed (KVPR)",
    "kvpr_bytes_saved": "KV bytes our loads did not read because they read activations, minus the activation bytes",
    "kvpr_activation_misses": "Pages whose activations were missing or corrupt in a load (their KV read instead)",
    "kvpr_activation_pages_written": "Activation pages written beside KV pages on SSD",
    "kvpr_activation_bytes_written": "Bytes of activation pages written to SSD",
    "kvpr_activation_drops": "Activation pages not stored because the write queue was full",
    "kvpr_fallbacks": "Compute-or-load loads declined or abandoned: SGLang loaded or computed the stored span",
    "kvpr_tokens_computed": "Tokens of stored spans whose KV was computed from their token ids (the front of a "
    "two-sided load)",
    "kvpr_tokens_loaded": "Tokens of stored spans read from storage by two-sided loads (the back)",
    "kvpr_read_samples": "Loads (ours and SGLang's, summed to 8 MiB or more) folded into the read rate that "
    "compute-or-load decisions use",
    "kvpr_computed_spans": "Stored spans `auto` left whole to SGLang's forward (reads too slow to help)",
    "retain_pins": "Requests whose prompt pages were pinned (custom_params.tiered_retain)",
    "retain_released": "Pins released before their expiry to keep pinned pages within --tiered-retain-share",
    "retain_refused": "Pins refused: the prompt alone has more pages than retention may hold",
}


class Events:
    """This process's counters of the mechanisms: `count(event)` adds to `sglang_tiered:<event>_total` when SGLang's
    Prometheus metrics are on (a no-op otherwise). One per process, in its `Runtime`."""

    def __init__(self) -> None:
        self._counters: dict = {}
        self._lock = threading.Lock()

    def count(self, event: str, value: float = 1) -> None:
        if event not in EVENTS:
            raise KeyError(event)
        if not prometheus_enabled(False) or value <= 0:
            return
        with self._lock:
            counter = self._counters.get(event)
            if counter is None:
                from prometheus_client import Counter

                counter = self._counters[event] = Counter(f"sglang_tiered:{event}_total", EVENTS[event])
        counter.inc(value)
