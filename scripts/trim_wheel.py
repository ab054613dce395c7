"""Drop files from a wheel in place: `python scripts/trim_wheel.py WHEEL PREFIX...` removes every file whose path in
the wheel starts with one of the prefixes, and its row in RECORD (pip writes RECORD anew on install)."""

import os
import sys
import zipfile


def trim(path: str, drop: tuple[str, ...]) -> tuple[int, int]:
    """(bytes before, bytes after)."""
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename.startswith(drop):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                rows = [r for r in data.decode().splitlines() if not r.startswith(drop)]
                data = ("\n".join(rows) + "\n").encode()
            dst.writestr(item, data)
    before, after = os.path.getsize(path), os.path.getsize(tmp)
    os.replace(tmp, path)
    return before, after


if __name__ == "__main__":
    before, after = trim(sys.argv[1], tuple(sys.argv[2:]))
    print(f"[gpu-wheels] {os.path.basename(sys.argv[1])}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
