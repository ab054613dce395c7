"""`sglang-tiered`: small commands around the plugin.

  sglang-tiered model-path          print (and on first use build) the embedded default model directory
  sglang-tiered stats --ssd-dir D   print the SSD tier statistics of every rank that used D
  sglang-tiered demo                run the scripted tier-hit demo (see sglang_tiered/demo.py)
  sglang-tiered runahead-tune       search chained-prefill partitions on this machine, write the lookup table
  sglang-tiered kvpr-profile        print the compute-or-load profile the servers measured (or measure a model)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from sglang_tiered.config import DEFAULT_PAGE_SIZE, TieredConfig, default_partitions_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-tiered", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("model-path", help="print the embedded default model directory (converted once)")
    stats = sub.add_parser("stats", help="print SSD tier statistics")
    stats.add_argument("--ssd-dir", default=TieredConfig().ssd_dir)
    stats.add_argument("--json", action="store_true")
    demo = sub.add_parser("demo", help="start a server and show device, host, SSD and after-restart hits")
    demo.add_argument("--workdir", default="demo-run", help="SSD directory and logs of the demo")
    demo.add_argument("--port", type=int, default=30123)
    tune = sub.add_parser("runahead-tune", help="search KV-Runahead partitions on this machine")
    tune.add_argument("--ranks", type=int, default=2)
    tune.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    tune.add_argument("--model-path", default="smollm2")
    tune.add_argument("--threads-per-rank", type=int, default=1)
    tune.add_argument("--repeats", type=int, default=3, help="timed runs per candidate (median)")
    tune.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    tune.add_argument("--out", default=str(default_partitions_path()),
                      help="where to write the table; the server reads this default path (default: %(default)s)")
    kvpr = sub.add_parser("kvpr-profile", help="print the compute-or-load profile the servers measured "
                          "under --ssd-dir, or measure a checkpoint now with --model-path")
    kvpr.add_argument("--ssd-dir", default=TieredConfig().ssd_dir)
    kvpr.add_argument("--model-path", help="measure this checkpoint on this machine and store the result (a server "
                      "of this model and dtype with 64-token pages and as many torch threads uses it)")
    kvpr.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    kvpr.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "kvpr-profile":
        return _kvpr_profile(args)

    if args.command == "model-path":
        import logging

        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        from sglang_tiered.models import default_model_path

        print(default_model_path())
        return 0
    if args.command == "stats":
        from sglang_tiered.integration.metrics import format_stats, read_stats_files

        rows = read_stats_files(args.ssd_dir)
        if args.json:
            print(json.dumps(rows, indent=1))
        for row in [] if args.json else rows:
            ns = row["namespace"]
            print(f"rank {ns['tp_rank']} namespace {ns['id']} ({ns['model']}, {ns['dtype']}, page {ns['page_size']}):")
            print("  " + format_stats(row, row["page_size"]))
        if not rows:
            print(f"no statistics under {args.ssd_dir}/stats", file=sys.stderr)
            return 1
        return 0
    if args.command == "runahead-tune":
        from sglang_tiered.engine.tuning import build_table
        from sglang_tiered.models import resolve_model_path

        if args.ranks < 2:
            parser.error("--ranks must be at least 2")
        spec = ("pretrained", resolve_model_path(args.model_path))
        table = build_table(args.ranks, spec, args.lengths, repeats=args.repeats, threads=args.threads_per_rank,
                            dtype=args.dtype)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        table.save(args.out)
        print(f"wrote {args.out}: {table.entries}")
        return 0
    if args.command == "demo":
        from sglang_tiered.demo import run_demo

        return run_demo(args.workdir, args.port)
    return 2


def _kvpr_profile(args) -> int:
    from sglang_tiered.engine import kvpr_profile
    from sglang_tiered.policy.kvpr import Shape, decide, gate

    if args.model_path:
        import torch

        from sglang_tiered.engine.llama import LlamaModel
        from sglang_tiered.models import model_fingerprint, resolve_model_path

        path = resolve_model_path(args.model_path)
        model = LlamaModel.from_pretrained(path, getattr(torch, args.dtype))
        c, item = model.cfg, model.dtype.itemsize
        Path(args.ssd_dir).mkdir(parents=True, exist_ok=True)
        prof = kvpr_profile.measure_profile(model, DEFAULT_PAGE_SIZE)
        bps = kvpr_profile.measure_read(Path(args.ssd_dir) / f".kvpr-read-probe-{os.getpid()}")
        shape = Shape(c.layers, c.hidden * item, 2 * c.kv_heads * c.head_dim * item)
        key = kvpr_profile.profile_key(model_fingerprint(path), str(model.dtype), DEFAULT_PAGE_SIZE, model.device)
        kvpr_profile.save_profile(args.ssd_dir, key, prof, read_bytes_per_s=bps, shape=shape.__dict__,
                                  page_size=DEFAULT_PAGE_SIZE)
    entries = kvpr_profile.load_profiles(args.ssd_dir)
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0 if entries else 1
    if not entries:
        print(f"no profile under {args.ssd_dir} (a server with --tiered-kvpr auto or force writes one once it "
              "has served a request; or pass --model-path)", file=sys.stderr)
        return 1
    for key, e in sorted(entries.items()):
        try:
            prof, bps = kvpr_profile.profile_of(e), float(e["read_bytes_per_s"])
        except (KeyError, TypeError, ValueError):
            print(f"{key}: not a profile of this version (measured again at the next server start)")
            continue
        print(f"{key} (measured {e.get('measured_at', '?')}): {kvpr_profile.describe(prof, bps)}")
        if "shape" in e:
            shape = Shape(**e["shape"])
            why = gate(shape)
            print(f"  activations {shape.x_bytes} B vs KV {shape.kv_bytes} B per token-layer: "
                  f"{'no activations: ' + why if why else 'gate open'}")
            ps = int(e.get("page_size", DEFAULT_PAGE_SIZE))
            for tokens in (1024, 4096, 8192):
                d = decide(tokens // ps, ps, shape, bps, prof, stored_activations=why is None)
                print(f"  auto, {tokens} stored tokens: {d.way}" + (" (activations)" if d.activations else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
