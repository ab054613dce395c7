"""Reads at arrival (`--tiered-kvpr-arrival-reads on`, under `--tiered-kvpr auto|force`): a request sent while a
scheduler runs a prefill forward has its stored prefix's SSD files read into the OS page cache by the launcher,
the last page first (storage/arrival_reads.py), until that forward ends.

Why: SGLang's scheduler takes in new requests only between forwards. One sent during a prefill forward (seconds on a
CPU; another request's whole prompt where it fits one chunk) waits for it unseen, and every read of its stored span
-- our loader's at admission (engine/early_reads.py), SGLang's prefetch -- begins after it. The launcher sees the
request at once.

Seam (listed in plugin.py): `TokenizerManager._send_one_request` (BEFORE, launcher process): each request sent to
the scheduler (those of a batch one by one).
* When: a scheduler rank marks an extend forward running on the server's forward board (storage/forward_board.py; marked
  by model_forward.ForwardHook on CPU servers, as the kvpr loader runs only there), the request's
  `custom_params.tiered_kvpr` is not 'off' or 'compute', and it is not a prompt to blend (`tiered_chunks`: blend.py
  serves it, not our loader). Between forwards, or during a decode step, the scheduler takes the request in at once (or
  within one step) and its own reads begin there.
* Which files: the leading run of the prompt's pages (SGLang's seeded hash chain over its tokens but the last, as the
  door keys them: keys.prompt_page_keys) stored as plain page files in the namespace directory of each scheduler rank
  of this server -- those whose `SERVER` file holds this launcher's pid (written by runtime.open_store) -- if the run
  holds at least --tiered-kvpr-min-tokens. Their KV files: where a model's activations are stored too, the loader
  reads a page whose KV is in the page cache as KV (engine/page_span.py). Pages the scheduler holds on device or in
  host memory are read too (the launcher cannot see its radix tree): disk reads spent while it computes.
* Until: before each file, the end of an extend forward on the board (the scheduler takes the request in: its own
  reads go on from there, the pages read so far in the page cache), or the request's first token, end or abort.
* The request is marked (`custom_params.tiered_arrival_reads`, which clients may not set: requests.py): its load
  reads the page cache, partly or wholly, so it is no sample of the disk's read rate, of compute's slowdown beside
  a loader or of a way's time (integration/kvpr.py).
* Counters: kvpr_arrival_reads, kvpr_arrival_bytes, kvpr_arrival_stopped; one log line per request.
A failure here is logged and the request goes on as without it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from sglang_tiered.integration.keys import prompt_page_keys
from sglang_tiered.integration.requests import ARRIVAL_PARAM, CHUNKS_PARAM, KVPR_PARAM, request_params
from sglang_tiered.integration.runtime import Runtime
from sglang_tiered.storage.arrival_reads import ArrivalRead, ArrivalReads
from sglang_tiered.storage.forward_board import ForwardBoard
from sglang_tiered.storage.ssd_tier import SERVER_FILE, page_path

logger = logging.getLogger("sglang_tiered")

NOT_LOADED = ("off", "compute")  # custom_params.tiered_kvpr values whose span our loader never reads


def served_dirs(ssd_dir: Path, pid: int) -> list[Path]:
    """The namespace directories under `ssd_dir` whose `SERVER` file names `pid` (this server's ranks), by name."""
    out = []
    try:
        entries = sorted(ssd_dir.iterdir())
    except OSError:
        return []
    for entry in entries:
        try:
            if (entry / SERVER_FILE).read_text().strip() == str(pid):
                out.append(entry)
        except OSError:
            continue
    return out


def stored_run(dirs: list[Path], keys: list[str]) -> tuple[int, list[Path]]:
    """The longest leading run of `keys` stored as page files in any of `dirs`, in pages, and those files, page by
    page from the front (each directory's own run: a rank's files only as far as that rank stored them)."""
    runs = []
    for d in dirs:
        n = 0
        while n < len(keys) and page_path(d, keys[n]).is_file():
            n += 1
        runs.append(n)
    pages = max(runs, default=0)
    return pages, [page_path(d, keys[i]) for i in range(pages) for d, n in zip(dirs, runs) if i < n]


class Arrival:
    """The launcher's reads at arrival (one reading thread, started at the first job)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.reads = ArrivalReads(self._done)
        self._dirs: list[Path] = []
        self._board: Optional[ForwardBoard] = None

    def before_send(self, manager, obj, *args, **kwargs) -> None:
        try:
            self._start(manager, obj)
        except Exception:  # noqa: BLE001 -- the request goes on as without reads at arrival
            logger.exception("tiered kvpr: reads at arrival failed for rid %s", getattr(obj, "rid", "?"))
        return None

    def _start(self, manager, obj) -> None:
        current = self.rt.settings
        if current is None:
            return
        cfg = current.config
        ids, rid = getattr(obj, "input_ids", None), getattr(obj, "rid", None)
        if cfg.kvpr == "off" or cfg.kvpr_arrival_reads != "on" or not ids or not isinstance(rid, str):
            return
        custom = request_params(obj)
        if custom.get(KVPR_PARAM, cfg.kvpr) in NOT_LOADED or CHUNKS_PARAM in custom:
            return
        board, dirs = self._served(Path(cfg.ssd_dir))
        if board is None or not dirs or not board.running():
            return
        ended = board.ended()
        page_size = int(manager.server_args.page_size or 1)
        keys = prompt_page_keys(ids, _extra_key(obj), getattr(obj, "cache_salt", None), len(ids) - 1, page_size)
        pages, paths = stored_run(dirs, keys)
        if pages * page_size < cfg.kvpr_min_tokens:
            return

        def stop() -> bool:  # the forward ended (the scheduler takes the request in), or the request did
            state = manager.rid_to_state.get(rid)
            return board.ended() != ended or state is None or state.finished or state.time_stats.first_token_time != 0

        params = obj.sampling_params  # the mark the scheduler's loader reads (its load is no sample of the disk)
        params.custom_params = {**(params.custom_params or {}), ARRIVAL_PARAM: True}
        self.reads.start(rid, paths, stop)

    def _served(self, ssd_dir: Path) -> tuple[Optional[ForwardBoard], list[Path]]:
        """The forward board and this server's namespace directories (found once the ranks opened their stores,
        before the server is ready)."""
        if self._board is None:
            self._board = ForwardBoard.open(ssd_dir)
        if not self._dirs:
            self._dirs = served_dirs(ssd_dir, os.getpid())
        return self._board, self._dirs

    def _done(self, read: ArrivalRead) -> None:
        events = self.rt.events
        events.count("kvpr_arrival_reads")
        events.count("kvpr_arrival_bytes", read.nbytes)
        if read.left:
            events.count("kvpr_arrival_stopped")
        logger.info("tiered kvpr: rid %s: %d of %d stored page files (%.1f MiB) read into the page cache from its "
                    "arrival, during a prefill forward, in %.2fs%s%s", read.name, read.files,
                    read.files + read.left + read.missing, read.nbytes / 2**20, read.seconds,
                    f"; stopped at that forward's end, {read.left} left" if read.left else "",
                    f"; {read.missing} gone before their turn" if read.missing else "")


def _extra_key(obj) -> Optional[str]:
    """The `extra_key` SGLang's scheduler gives the request: the LoRA adapter's id appended (schedule_batch.Req)."""
    extra, lora = getattr(obj, "extra_key", None), getattr(obj, "lora_id", None)
    return (extra or "") + lora if lora is not None else extra


def register_hooks(rt: Runtime) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    rt.arrival = arrival = Arrival(rt)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._send_one_request",
                          arrival.before_send, HookType.BEFORE)
