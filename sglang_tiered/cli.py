"""`sglang-tiered`: small commands around the plugin.

  sglang-tiered model-path          print (and on first use build) the embedded default model directory
  sglang-tiered stats --ssd-dir D   print the SSD tier statistics of every rank that used D
  sglang-tiered demo                run the scripted tier-hit demo (see sglang_tiered/demo.py)
"""

from __future__ import annotations

import argparse
import json
import sys

from sglang_tiered.config import TieredConfig


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
    args = parser.parse_args(argv)

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
    if args.command == "demo":
        from sglang_tiered.demo import run_demo

        return run_demo(args.workdir, args.port)
    return 2


if __name__ == "__main__":
    sys.exit(main())
