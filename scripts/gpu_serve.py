"""Serving checks of `python -m sglang.launch_server --kv-backend tiered` on the machine it runs on (a GPU through
scripts/gpu-serve.sh; a CPU through scripts/gpu-rehearse.sh), on random weights (`--load-format dummy`, a generated
Llama config, the embedded model's tokenizer). Writes OUT/serve.json after every check; a check that fails records
its error (each server's log is in OUT too), and the next one runs.

1. `tiers` (per length): after a warm-up prefill of the same length (the first one of a length compiles Triton
   kernels), a prompt of random token ids, 8 greedy tokens cold (a full prefill: its TTFT is the recompute
   baseline), again (a device hit), after other prompts filled the device pool (a host hit), after /flush_cache with
   the SSD files evicted from the page cache (an SSD hit), and after a restart on the same directory (an SSD hit):
   every answer must equal the cold one, and each hit must come from its tier.
2. `blend`: a marked prompt (10 chunks of random ids, then a question) asked once, then with its chunks reordered:
   TTFT against the cold prefill of the reordered prompt, and whether the server blended it or fell back.
3. `kvpr`: `--tiered-kvpr force`, an SSD hit loaded by compute-or-load: the cold answer.
4. `gated`: `--tiered-importance-load gated` (on CUDA with `--attention-backend torch_native`), the prompt repacked,
   then an SSD hit by the sparse path loading everything (the cold answer) and gated (answered).
   On CUDA 3 and 4 run with SGLANG_TIERED_CUDA_PREVIEW=1; each passes only if our loader ran (its log line), without
   a fallback or a failure in the log.
5. `hicache_file`: SGLang's own HiCache with its `file` storage backend on the same prompts: cold, then after
   /flush_cache with its files evicted from the page cache -- the TTFT of its storage hit against ours. It runs
   SGLang's Python tree core, as ours does with retention on: SGLang 0.5.23's Rust tree core links libtorch and,
   under the image's torch 2.11, misreads the int64 tensor of its first insert ("got Uint8").
6. `blend_graphs` (last: its server captures CUDA graphs): `blend` with SGLang's CUDA graphs as by default, where
   the launcher must turn the prefill graph off (a replayed prefill runs past our hook) and blending must run.

    python scripts/gpu_serve.py OUT [--shape 7b-mha] [--lengths 4096 16384] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _harness import evict_from_page_cache  # noqa: E402

from sglang_tiered.models import default_model_path, dummy_model_dir  # noqa: E402
from sglang_tiered.server_process import ServerProcess, cached_details  # noqa: E402

VOCAB = 49152
NEW = 8
WARM = 10**6  # seeds of the warm-up prompts, apart from every measured one
PYTHON_TREE_CORE = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}  # the baseline's (see check 5)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, VOCAB - 1000) for _ in range(n)]


def ask(s: ServerProcess, prompt: list[int], new: int = NEW, chunks: list[int] | None = None, **custom) -> dict:
    """A greedy streamed /generate of `new` tokens: TTFT (the first streamed chunk, client side), the output token
    ids, where the cached tokens came from. `custom`: more custom_params (e.g. tiered_importance="full")."""
    params: dict = {"max_new_tokens": new, "temperature": 0, "custom_params": dict(custom)}
    if chunks is not None:
        params["custom_params"]["tiered_chunks"] = chunks
    host, port = s.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/generate", json.dumps({"input_ids": prompt, "sampling_params": params, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"/generate answered {resp.status}: {resp.read()[:500]!r}")
    ttft, last = None, None
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data:") and line != "data: [DONE]":
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            last = json.loads(line[5:])
    conn.close()
    return {"ttft_s": round(ttft, 4), "tokens": last["output_ids"], "cached": cached_details(last)}


class Run:
    def __init__(self, out: Path, args) -> None:
        import torch

        self.out, self.args = out, args
        self.cuda = torch.cuda.is_available()
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-serve-"))
        tok = args.tokenizer or default_model_path()
        self.model = str(dummy_model_dir(self.tmp / "model", args.shape, tok))
        self.data: dict = {"device": torch.cuda.get_device_name() if self.cuda else "cpu", "torch": torch.__version__,
                           "shape": args.shape, "lengths": args.lengths, "checks": {}}
        self.longest = max(args.lengths)
        self.pool = int(2.5 * self.longest) + 256  # device KV pool (tokens)

    def save(self) -> None:
        (self.out / "serve.json").write_text(json.dumps(self.data, indent=1))

    def server(self, name: str, ssd: Path, *extra: str, backend: bool = True, attention: str = "triton",
               env: dict | None = None, graphs: bool = False) -> ServerProcess:
        """`graphs`: SGLang's CUDA graphs as a server starts with by default (decode batches up to 4 captured, to
        keep the start short); else none."""
        common = ["--load-format", "dummy", "--max-total-tokens", str(self.pool), "--context-length",
                  str(self.longest + 256), "--chunked-prefill-size", "8192"]
        if self.cuda:  # flashinfer is not carried: Triton attention (or torch_native), PyTorch sampling
            common += [*(["--cuda-graph-max-bs-decode", "4"] if graphs else ["--disable-cuda-graph"]),
                       "--mem-fraction-static", "0.6", "--attention-backend", attention, "--sampling-backend",
                       "pytorch"]
        elif not backend:  # SGLang's own HiCache on a CPU (what `--kv-backend tiered` sets by itself)
            common += ["--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first", "--page-size", "64"]
        tiered = ["--kv-backend", "tiered", "--tiered-ssd-dir", str(ssd), "--tiered-stats-interval", "0"]
        return ServerProcess([*(tiered if backend else []), *common, *extra], log_path=self.out / f"{name}.log",
                             model_path=self.model, startup_timeout=self.args.startup_s, env=env)

    def check(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            result = fn()
            result["passed"] = bool(result.get("passed", True))
        except Exception as exc:  # recorded; the next check runs
            result = {"passed": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        self.data["checks"][name] = result
        self.save()
        print(f"[gpu-serve] {name}: {'passed' if result['passed'] else 'FAILED'} ({result['wall_s']} s)"
              + (f" {result.get('error', '')}" if not result["passed"] else ""), flush=True)

    def tiers(self) -> dict:
        ssd = self.tmp / "ssd-tiered"
        rows, cold_tokens, ok = {}, {}, True
        prompts = {n: ids(n, n) for n in self.args.lengths}
        with self.server("tiered", ssd, "--enable-metrics") as s:
            for n, p in prompts.items():
                ask(s, ids(n, WARM + n), 1)  # a prefill of this length first: the cold TTFT is not Triton's JIT
                cold = ask(s, p)
                device = ask(s, p)
                for k in range(1, self.pool // n + 2):  # other prompts until the device pool has turned over
                    ask(s, ids(n, n + k), 1)
                host = ask(s, p)
                s.flush_cache()
                evict_from_page_cache(ssd)
                ssd_hit = ask(s, p)
                rows[n] = {"recompute_ttft_s": cold["ttft_s"], "ssd_hit_ttft_s": ssd_hit["ttft_s"],
                           "device": device["cached"], "host": host["cached"], "ssd": ssd_hit["cached"],
                           "same_tokens": [device["tokens"] == cold["tokens"], host["tokens"] == cold["tokens"],
                                           ssd_hit["tokens"] == cold["tokens"]]}
                ok &= all(rows[n]["same_tokens"]) and device["cached"]["device"] > 0 and \
                    host["cached"]["host"] > 0 and ssd_hit["cached"]["storage"] > 0
                cold_tokens[n] = cold["tokens"]
        evict_from_page_cache(ssd)
        with self.server("tiered-restart", ssd) as s:
            for n, p in prompts.items():
                again = ask(s, p)
                rows[n]["restart"] = {"ttft_s": again["ttft_s"], "cached": again["cached"],
                                      "same_tokens": again["tokens"] == cold_tokens[n]}
                ok &= again["tokens"] == cold_tokens[n] and again["cached"]["storage"] > 0
        return {"passed": ok, "lengths": rows}

    def hicache_file(self) -> dict:
        files = self.tmp / "hicache-file"
        rows = {}
        with self.server("hicache-file", files, "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                         "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(files)}),
                         "--hicache-ratio", "2", backend=False, env=PYTHON_TREE_CORE) as s:
            for n in self.args.lengths:
                p = ids(n, n)
                ask(s, ids(n, WARM + n), 1)
                cold = ask(s, p)
                s.flush_cache()
                evict_from_page_cache(files)
                hit = ask(s, p)
                rows[n] = {"recompute_ttft_s": cold["ttft_s"], "storage_hit_ttft_s": hit["ttft_s"],
                           "cached": hit["cached"], "same_tokens": hit["tokens"] == cold["tokens"]}
        return {"lengths": rows, "tree_core": "python"}

    def blend(self, graphs: bool = False) -> dict:
        chunks = [ids(self.args.chunk_tokens, 100 + i) for i in range(10)]
        question = ids(32, 99)
        order = list(range(10))
        random.Random(7).shuffle(order)

        def marked(o: list[int]) -> tuple[list[int], list[int]]:
            parts = [chunks[i] for i in o] + [question]
            return sum(parts, []), [len(x) for x in parts]

        name = "blend-graphs" if graphs else "blend"
        s = self.server(name, self.tmp / f"ssd-{name}", "--tiered-blend", "blend", graphs=graphs)
        start = s.log_mark()  # (a rerun into the same OUT appends to the log)
        with s:
            eager = bool(s.log_lines("--disable-prefill-cuda-graph", start))  # the launcher's line (graphs on)
            first_ids, lengths = marked(list(range(10)))
            ask(s, first_ids, 1, chunks=lengths)
            mark = s.log_mark()
            p, lengths = marked(order)
            blended = ask(s, p, chunks=lengths)
            blend_lines = s.log_lines("tiered blend: rid", mark)
            fallbacks = s.log_lines("runs a normal prefill", mark)
            s.flush_cache()
            cold = ask(s, p)  # the same tokens unmarked: SGLang's own prefill (the blend namespace is apart)
        return {"passed": bool(blend_lines) and not fallbacks and (eager or not (graphs and self.cuda)),
                "blend_ttft_s": blended["ttft_s"], "prefill_ttft_s": cold["ttft_s"],
                "blended_forwards": len(blend_lines), "fallbacks": fallbacks[:3], "prefill_graph_off": eager,
                "same_first_tokens": blended["tokens"][:4] == cold["tokens"][:4]}

    def blend_graphs(self) -> dict:
        """`blend` on a server with SGLang's CUDA graphs as by default: the launcher turns the prefill graph off
        (a replayed prefill would run past our hook) and blending runs; decode graphs replay over blended KV."""
        return self.blend(graphs=True)

    def kvpr(self) -> dict:
        """Compute-or-load forced (on CUDA as the preview): the prompt cold, then from SSD -- the cold answer."""
        return self._from_ssd("kvpr", ["--tiered-kvpr", "force"], "triton",
                              [("kvpr", None, "tiered kvpr: rid", True)])

    def gated(self) -> dict:
        """Gated loading (on CUDA as the preview, with torch_native attention, the backend whose decode skips a
        sparse load's holes): the prompt cold and repacked, then from SSD by the sparse path loading everything
        (`full`: the cold answer) and gated (answered)."""
        return self._from_ssd("gated", ["--tiered-importance-load", "gated"], "torch_native",
                              [("full", "full", "tiered sparse: rid", True),
                               ("gated", None, "tiered sparse: rid", False)], repack=True)

    def _from_ssd(self, name: str, flags: list[str], attention: str, ways: list, repack: bool = False) -> dict:
        """A server with `flags`; the shortest prompt cold, then for each (way, tiered_importance, log line, exact)
        of `ways`: /flush_cache, its files evicted from the page cache, asked again. Passed when every way ran our
        loader (its log line, no fallback), the exact ones gave the cold answer, and nothing failed in the log."""
        n = min(self.args.lengths)
        p = ids(n, n)
        ssd = self.tmp / f"ssd-{name}"
        preview = {"SGLANG_TIERED_CUDA_PREVIEW": "1"} if self.cuda else None
        s = self.server(name, ssd, *flags, "--enable-metrics", attention=attention, env=preview)
        start = s.log_mark()  # the log is appended to: a rerun into the same OUT reads only its own lines
        try:
            s.start()
        except RuntimeError as exc:
            log = s.log_since(start).splitlines()
            refusal = [line for line in log if "--tiered-" in line][-3:]
            return {"passed": False, "refused": refusal or str(exc)}
        ok = True
        try:  # (started above: `with s` would start it a second time)
            cold = ask(s, p)
            rows: dict = {"cold_ttft_s": cold["ttft_s"]}
            if repack:
                deadline = time.monotonic() + 120
                while not s.log_lines("tiered repack:", start) and time.monotonic() < deadline:
                    time.sleep(0.5)
                rows["repacked"] = bool(s.log_lines("tiered repack:", start))
            for way, mode, line, exact in ways:
                s.flush_cache()
                evict_from_page_cache(ssd)
                mark = s.log_mark()
                out = ask(s, p, **({"tiered_importance": mode} if mode else {}))
                row = {"ttft_s": out["ttft_s"], "cached": out["cached"], "same_tokens": out["tokens"] == cold["tokens"],
                       "ran": s.log_lines(line, mark)[-1:], "fallbacks": s.log_lines("runs a normal prefill", mark)[-2:]
                       + s.log_lines("SGLang computes the span", mark)[-2:]}
                ok &= bool(row["ran"]) and not row["fallbacks"] and (row["same_tokens"] or not exact)
                rows[way] = row
            failures = s.log_lines("failed on rid", start) + s.log_lines("Traceback", start)
        finally:
            s.stop()
        return {"passed": ok and not failures, **rows, "failures": failures[:5]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default=None, help="7b-mha, 8b-gqa or small-mha (default: 7b-mha on CUDA)")
    ap.add_argument("--lengths", nargs="+", type=int, default=None, help="default: 4096 16384 on CUDA, 1024 on CPU")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="tokens per blend chunk (default: longest / 12)")
    ap.add_argument("--tokenizer", default=None, help="a directory with the embedded model's tokenizer files")
    ap.add_argument("--startup-s", type=float, default=240.0)
    ap.add_argument("--checks", nargs="+", default=["tiers", "blend", "kvpr", "gated", "hicache_file",
                                                     "blend_graphs"])
    a = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    a.shape = a.shape or ("7b-mha" if cuda else "small-mha")
    a.lengths = a.lengths or ([4096, 16384] if cuda else [1024])
    a.chunk_tokens = a.chunk_tokens or max(a.lengths) // 12
    a.out.mkdir(parents=True, exist_ok=True)
    run = Run(a.out, a)
    for name in a.checks:
        run.check(name, getattr(run, name))
    passed = sum(c["passed"] for c in run.data["checks"].values())
    print(f"[gpu-serve] {passed}/{len(run.data['checks'])} checks passed; {a.out / 'serve.json'}")
    return 0 if passed == len(run.data["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
