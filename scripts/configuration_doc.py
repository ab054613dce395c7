"""Write docs/configuration.md from sglang_tiered/config.py (every --tiered-* flag, its default and help, grouped by
mechanism). `python scripts/configuration_doc.py --check` exits 1 where the file differs from what it would write."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from sglang_tiered.config import CHOICES, FLAG_HELP, TieredConfig

OUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
GROUPS = [  # (title, field prefixes or names, the doc that explains them)
    ("The store", ("ssd_dir", "ssd_capacity", "host_size", "namespace", "prefetch_threshold", "io_threads",
                   "stats_interval", "max_retain", "retain_share"), "store.md"),
    ("CPU servers", ("cpu_attention",), "cpu.md"),
    ("Gated sparse loading (IMPRESS)", ("importance_",), "importance.md"),
    ("Chunk reuse (CacheBlend)", ("blend",), "blend.md"),
    ("Compute-or-load (Cake, KVPR)", ("kvpr",), "kvpr.md"),
    ("Chained prefill (KV-Runahead)", ("runahead_",), "runahead.md"),
    ("Shared tier (Mooncake)", ("remote",), "remote.md"),
]


def render() -> str:
    fields = [f for f in dataclasses.fields(TieredConfig)]
    out = ["# Configuration", "",
           "Every `--tiered-*` flag of `python -m sglang.launch_server --kv-backend tiered`, grouped by mechanism, as "
           "`--help` prints it. The README lists the ones an operator usually sets. Generated from "
           "`sglang_tiered/config.py` by `python scripts/configuration_doc.py`.", ""]
    seen = set()
    for title, keys, doc in GROUPS:
        group = [f for f in fields if f.name not in seen and any(f.name == k or (k.endswith("_") and
                                                                                  f.name.startswith(k)) or
                                                                  (k in ("blend", "kvpr", "remote") and
                                                                   f.name.startswith(k)) for k in keys)]
        seen.update(f.name for f in group)
        out += [f"## {title}", "", f"Explained in [{doc}]({doc}).", "", "| flag | default | meaning |",
                "| --- | --- | --- |"]
        for f in group:
            flag = "--tiered-" + f.name.replace("_", "-")
            if f.name in CHOICES:
                flag += " {" + ",".join(str(c) for c in CHOICES[f.name]) + "}"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = {"ssd_dir": "~/.cache/sglang-tiered/ssd", "ssd_capacity": "16G"}.get(f.name, default)
            default = "(none)" if default == "" else default
            text = FLAG_HELP.get(f.name, "").replace("%(default)s", str(default)).replace("|", "\\|")
            out.append(f"| `{flag}` | `{default}` | {text} |")
        out.append("")
    missing = [f.name for f in fields if f.name not in seen]
    if missing:
        raise SystemExit(f"flags in no group: {missing}")
    return "\n".join(out)


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        return 0 if OUT.read_text() == text else 1
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
