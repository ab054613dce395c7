"""The SSD tier's recovery scan at startup: what a namespace's directory (and, for rank 0, the rest of the root)
holds, as entries for the index -- names, sizes and mtimes only (headers are checked lazily on read). Interrupted
writes (temporary files), unreadable or foreign groups, and member pages of a committed group (a crash between the
group's rename and its pages' removal) are removed on the way."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sglang_tiered.storage import activations, group_file
from sglang_tiered.storage.files import unlink_quiet
from sglang_tiered.storage.namespace import Namespace
from sglang_tiered.storage.page_file import PAGE_SUFFIX, TMP_SUFFIX
from sglang_tiered.storage.tier_layout import (
    CHUNK_PREFIX,
    FOREIGN_PREFIX,
    GROUP_PREFIX,
    META_PREFIX,
    NAMESPACE_FILE,
    NAMESPACE_META,
    ROOT_FILES,
)

logger = logging.getLogger("sglang_tiered.storage.ssd_tier")

Entry = tuple[float, str, int, str]  # (mtime, index key, size, kind)


@dataclass
class Scan:
    """What the directory holds: `entries` of this rank in recency order (oldest first), `foreign` files (when
    asked), the committed `groups` by gid, and how many interrupted writes were removed."""

    entries: list[Entry] = field(default_factory=list)
    foreign: list[Entry] = field(default_factory=list)
    groups: dict[str, group_file.GroupMeta] = field(default_factory=dict)
    removed_tmp: int = 0


def scan(root: Path, namespace: Namespace, scan_foreign: bool) -> Scan:
    """Scan the namespace's directory under `root` (and, with `scan_foreign`, every file of the root no rank of this
    server owns)."""
    ns_id, directory = namespace.id, root / namespace.id
    out = Scan()
    group_entries = _scan_groups(directory, ns_id, out.groups)
    members = {key for meta in out.groups.values() for key in meta.keys}
    for entry in _walk(directory):
        rel = Path(entry.path).relative_to(directory)
        st = entry.stat()
        if entry.name.endswith(TMP_SUFFIX):
            unlink_quiet(Path(entry.path))
            out.removed_tmp += 1
            continue
        if rel.parts[0] == "groups":
            continue
        if len(rel.parts) == 1 and entry.name in NAMESPACE_META:
            out.entries.append((st.st_mtime, META_PREFIX + f"{ns_id}/{entry.name}", st.st_size, "meta"))
            continue
        if entry.name.endswith(PAGE_SUFFIX) and len(rel.parts) == 2:
            stem = entry.name[: -len(PAGE_SUFFIX)]
            if rel.parts[0] == "chunks":
                out.entries.append((st.st_mtime, CHUNK_PREFIX + stem, st.st_size, "chunk"))
                continue
            if stem in members:  # its group committed; the crash came before this file was removed
                unlink_quiet(Path(entry.path))
                continue
            kind = "activation" if activations.is_activation(stem) else "page"
            out.entries.append((st.st_mtime, stem, st.st_size, kind))
            continue
        out.entries.append((st.st_mtime, FOREIGN_PREFIX + f"{ns_id}/{rel}", st.st_size, "foreign"))
    for name in (f"stats/{ns_id}.json", *ROOT_FILES):
        path = root / name
        if path.is_file():
            out.entries.append((path.stat().st_mtime, META_PREFIX + name, path.stat().st_size, "meta"))
    out.entries.extend(group_entries)
    out.entries.sort()
    if scan_foreign:
        out.foreign = sorted(_scan_foreign(root, namespace))
    return out


def load(found: Scan, index, groups: dict[str, group_file.GroupMeta]) -> None:
    """Enter a scan's files into the tier's `index` (a `DiskIndex`; the caller holds its lock) and its groups into
    `groups`."""
    groups.update(found.groups)
    for _, key, size, _ in found.foreign:
        index.load(key, size, "foreign")
    for _, key, size, kind in found.entries:
        if kind == "group":
            index.load(key, size, kind, members=groups[key[len(GROUP_PREFIX):]].keys)
        else:
            index.load(key, size, kind, parent=activations.page_of(key) if kind == "activation" else None)


def _scan_groups(directory: Path, ns_id: str, groups: dict[str, group_file.GroupMeta]) -> list[Entry]:
    """Committed groups under groups/ (added to `groups`); temporary, unreadable and foreign files removed."""
    out: list[Entry] = []
    gdir = directory / "groups"
    if not gdir.is_dir():
        return out
    for entry in os.scandir(gdir):
        if not entry.name.endswith(group_file.GROUP_SUFFIX):
            unlink_quiet(Path(entry.path))
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                meta = group_file.read_meta(fd)
            finally:
                os.close(fd)
        except (OSError, group_file.GroupError) as exc:
            logger.warning("tiered ssd: unreadable group %s (%s): removed", entry.name, exc)
            unlink_quiet(Path(entry.path))
            continue
        if meta.ns != ns_id:
            unlink_quiet(Path(entry.path))
            continue
        groups[meta.gid] = meta
        st = entry.stat()
        out.append((st.st_mtime, GROUP_PREFIX + meta.gid, st.st_size, "group"))
    return out


def _scan_foreign(root: Path, namespace: Namespace) -> list[Entry]:
    """Files under the root that no rank of this server owns: other namespaces' directories and statistics, older
    layouts, anything else. Another rank's directory (same namespace but for the TP/PP rank) is not foreign: that
    rank counts it."""
    siblings = {namespace.id}
    for entry in os.scandir(root):
        if entry.is_dir() and _is_sibling(Path(entry.path) / NAMESPACE_FILE, namespace):
            siblings.add(entry.name)
    out = []
    for entry in _walk(root, skip=siblings):  # (this rank's own directory is scanned apart)
        rel = Path(entry.path).relative_to(root)
        if str(rel) in ROOT_FILES:
            continue
        if rel.parts[0] == "stats" and len(rel.parts) == 2 and rel.stem in siblings:
            continue
        if entry.name.startswith(".write-check-"):  # config validation's probe of another starting server
            continue
        out.append((entry.stat().st_mtime, FOREIGN_PREFIX + str(rel), entry.stat().st_size, "foreign"))
    return out


def _walk(top: Path, skip: frozenset | set = frozenset()) -> Iterator[os.DirEntry]:
    """Every regular file under `top` (symlinks not followed), not descending into `top`'s directories named in
    `skip`."""
    stack = [top]
    while stack:
        here = stack.pop()
        try:
            entries = list(os.scandir(here))
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                if not (here == top and entry.name in skip):
                    stack.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                yield entry


def _is_sibling(desc_path: Path, ns: Namespace) -> bool:
    """True if `desc_path` describes `ns` but for its TP/PP rank (another rank of the same server)."""
    try:
        desc = json.loads(desc_path.read_text())
    except (OSError, ValueError):
        return False
    ranks = ("id", "tp_rank", "pp_rank")
    mine = {k: v for k, v in ns.describe().items() if k not in ranks}
    return {k: v for k, v in desc.items() if k not in ranks} == mine
