"""The budget of one SSD directory: which objects it holds, their bytes, and which leave first. Pure bookkeeping:
no files, no threads of its own (the tier does the I/O on top and calls it under one lock), so every decision can be
tested with exact keys and victims.

Entries: every file the tier keeps is one entry of one kind (`KINDS`):
* `page`: a KV page; `activation`: a page's attention inputs, a *dependent* of its page (no use without it: it
  leaves with its page, and on its own like any entry; it may arrive before its page); `chunk`: a text chunk's
  position-0 KV (blending); `group`: repacked pages (`commit_group`): the members' page keys resolve to the
  group, which is kept, touched and evicted as one entry;
* `meta`: the namespace description, the importance log, statistics, profiles, probe files: counted, never evicted
  (their owners bound them and grow them through `resize`);
* `foreign`: a file under the directory that this server cannot use (another namespace, an older layout): counted
  so that the directory stays within the capacity, evicted first.

Bytes: `used` = committed entries + reservations in flight <= `capacity` after every call. Victims leave the
index at once: the owner deletes their files before anyone can reserve again (the tier does it under the lock it
calls the index with), so no writer ever gets the room of a file that still exists, and the files never exceed the
capacity.

Eviction order, one comparison: candidates are the entries of every kind but meta that are not pinned
(`pinned(key)`: retention, `policy/retention.py`; a group is pinned when one of its members is, an activation when
its page is), least recently used first, where a foreign file counts as never used (it goes before every entry of
ours). Why LRU across kinds: each kind's miss costs a recompute of roughly its bytes' worth of prefill, and
recency is the one signal all kinds share.
Pinned entries are never candidates: a write that only pinned entries could make room for is refused.

`reserve` never evicts for a write it then refuses: victims are chosen only when they free enough.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Optional

KINDS = ("page", "activation", "chunk", "group", "meta", "foreign")
EVICTABLE = frozenset({"page", "activation", "chunk", "group", "foreign"})  # the kinds that are candidates


@dataclass(frozen=True)
class Victim:
    """An entry removed from the index: its file is to be deleted before the index is used again."""

    key: str
    size: int
    kind: str


@dataclass(frozen=True)
class Reservation:
    """What `reserve` / `resize` decided. `admitted`: the bytes are reserved (commit or abort them); `stored`: the key
    is stored or being stored already (nothing reserved); `victims`: removed to make room (delete their files)."""

    admitted: bool
    stored: bool = False
    victims: tuple[Victim, ...] = ()


@dataclass
class _Entry:
    size: int
    kind: str
    parent: Optional[str] = None  # an activation's page
    members: tuple[str, ...] = ()  # a group's page keys


class DiskIndex:
    """Not thread-safe on its own: the owner calls it under one lock."""

    def __init__(self, capacity: int, pinned: Callable[[str], bool] = lambda key: False) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        self._pinned = pinned
        self._entries: dict[str, _Entry] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # our candidates' keys, least recently used first
        self._foreign: OrderedDict[str, None] = OrderedDict()  # foreign files, in the order found (before _lru)
        self._dependents: dict[str, set[str]] = {}  # page -> its activation entries
        self._group_of: dict[str, str] = {}  # member page key -> group entry key
        self._writing: dict[str, tuple[int, str, Optional[str]]] = {}  # key -> (reserved bytes, kind, parent)
        self._used = 0
        self._by_kind: Counter[str] = Counter()  # committed bytes per kind
        self._count: Counter[str] = Counter()  # committed entries per kind

    # ----------------------------------------------------------------- queries
    @property
    def used(self) -> int:
        """Bytes of committed entries and reservations (<= capacity)."""
        return self._used

    def contains(self, key: str) -> bool:
        """True if `key` is a committed entry or a member of a committed group."""
        return key in self._entries or key in self._group_of

    def holder(self, key: str) -> Optional[str]:
        """The entry that holds `key`: itself, its group, or None."""
        if key in self._entries:
            return key
        return self._group_of.get(key)

    def group_of(self, key: str) -> Optional[str]:
        """The group entry holding page `key`, or None."""
        return self._group_of.get(key)

    def size(self, key: str) -> Optional[int]:
        entry = self._entries.get(key)
        return entry.size if entry is not None else None

    def kind(self, key: str) -> Optional[str]:
        entry = self._entries.get(key)
        return entry.kind if entry is not None else None

    def writing(self, key: str) -> bool:
        return key in self._writing

    def leading_hits(self, keys: Sequence[str]) -> int:
        """Length of the leading run of `keys` that are stored."""
        for i, key in enumerate(keys):
            if not self.contains(key):
                return i
        return len(keys)

    def keys(self, kind: str) -> list[str]:
        return [k for k, e in self._entries.items() if e.kind == kind]

    def bytes_by_kind(self) -> dict[str, int]:
        """Committed bytes per kind (every kind listed), plus "in_flight": reservations of writes in progress."""
        out = {kind: self._by_kind[kind] for kind in KINDS}
        out["in_flight"] = sum(size for size, _, _ in self._writing.values())
        return out

    def stored_pages(self) -> int:
        """KV pages held, plain or in groups."""
        return self._count["page"] + len(self._group_of)

    def pinned_bytes(self) -> int:
        return sum(e.size for k, e in self._entries.items() if e.kind in EVICTABLE and self._is_pinned(k, e))

    # ----------------------------------------------------------------- reservations
    def reserve(self, key: str, size: int, kind: str, *, parent: Optional[str] = None,
                keep: Iterable[str] = ()) -> Reservation:
        """Reserve `size` bytes for a new entry `key`, evicting candidates (never those in `keep`) if needed.
        Refused (nothing evicted) if the key is larger than the capacity or the candidates cannot free enough. A
        key stored, being stored, or a group member: `stored`."""
        _check_kind(kind)
        if key in self._entries or key in self._writing or key in self._group_of:
            return Reservation(admitted=False, stored=True)
        if size > self.capacity:
            return Reservation(admitted=False)
        victims = self._make_room(size, set(keep) | ({parent} if parent else set()))
        if victims is None:
            return Reservation(admitted=False)
        self._writing[key] = (size, kind, parent)
        self._used += size
        return Reservation(admitted=True, victims=victims)

    def commit(self, key: str, size: int) -> tuple[Victim, ...]:
        """The reserved entry `key` is complete and holds `size` bytes (its actual size; if a bound reserved was
        too small, candidates are evicted for the difference at once: returned)."""
        reserved, kind, parent = self._writing.pop(key)
        self._used += size - reserved
        self._add(key, _Entry(size, kind, parent))
        return self.shrink()

    def abort(self, key: str) -> None:
        """Give back the reservation of `key` (the write failed)."""
        reserved, _, _ = self._writing.pop(key)
        self._used -= reserved

    def resize(self, key: str, size: int) -> Reservation:
        """A committed meta entry grows or shrinks to `size` bytes (an append-only log, a file rewritten beside its
        old copy). Growing may evict; refused (size unchanged, nothing evicted) if the room is not there."""
        entry = self._entries[key]
        if entry.kind != "meta":
            raise ValueError(f"only meta entries are resized, {key!r} is a {entry.kind}")
        grow = size - entry.size
        if grow <= 0:
            self._set_size(key, entry, size)
            return Reservation(admitted=True)
        if size > self.capacity:
            return Reservation(admitted=False)
        victims = self._make_room(grow, set())
        if victims is None:
            return Reservation(admitted=False)
        self._set_size(key, entry, size)
        return Reservation(admitted=True, victims=victims)

    def commit_group(self, key: str, size: int, members: Sequence[str]) -> tuple[Victim, ...]:
        """The reserved group `key` (reserved with `keep=members`) is committed with `size` bytes: its member pages
        leave the index (returned as victims, with their dependents: delete their files) and resolve to the group
        from now on."""
        reserved, kind, _ = self._writing.pop(key)
        if kind != "group":
            raise ValueError(f"{key!r} was reserved as a {kind}, not a group")
        victims: list[Victim] = []
        for member in members:
            if member in self._entries:
                victims.extend(self._remove_locked(member))
        self._used += size - reserved
        self._add(key, _Entry(size, "group", members=tuple(members)))
        self._group_of.update({m: key for m in members})
        return tuple(victims) + self.shrink()

    # ----------------------------------------------------------------- removal
    def remove(self, key: str) -> tuple[Victim, ...]:
        """Remove entry `key` (a lost or corrupt file, or a cleared one) with its dependents and group members."""
        if key not in self._entries:
            return ()
        return tuple(self._remove_locked(key))

    def clear(self) -> tuple[Victim, ...]:
        """Remove every page, chunk and group (pinned ones too; SGLang's storage `clear`), with their dependents."""
        victims: list[Victim] = []
        for key in [k for k, e in self._entries.items() if e.kind in EVICTABLE and e.kind != "foreign"]:
            if key in self._entries:
                victims.extend(self._remove_locked(key))
        return tuple(victims)

    def shrink(self) -> tuple[Victim, ...]:
        """Evict until `used` fits the capacity (after `load` found more than it, or the capacity was lowered).
        Pinned entries stay (then `used` may stay above the capacity until they expire)."""
        over = self._used - self.capacity
        if over <= 0:
            return ()
        return tuple(self._pick(over, set(), best_effort=True))

    # ----------------------------------------------------------------- recency
    def touch(self, key: str) -> None:
        """`key` (or the group holding it) was used: it leaves last among the candidates."""
        holder = self.holder(key)
        if holder is not None and holder in self._lru:
            self._lru.move_to_end(holder)

    # ----------------------------------------------------------------- startup
    def load(self, key: str, size: int, kind: str, *, parent: Optional[str] = None,
             members: Sequence[str] = ()) -> bool:
        """Index a file found on disk (call in recency order, least recent first; foreign files first). False (not
        indexed: delete the file) for a key indexed already."""
        _check_kind(kind)
        if key in self._entries:
            return False
        self._used += size
        self._add(key, _Entry(size, kind, parent, tuple(members)))
        if kind == "group":
            self._group_of.update({m: key for m in members})
        return True

    # ----------------------------------------------------------------- invariants (tests)
    def check(self) -> None:
        committed = sum(e.size for e in self._entries.values())
        writing = sum(size for size, _, _ in self._writing.values())
        assert self._used == committed + writing, "used bytes drifted"
        assert set(self._lru) | set(self._foreign) == {k for k, e in self._entries.items() if e.kind in EVICTABLE}, \
            "candidates drifted"
        for key, deps in self._dependents.items():
            assert all(d in self._entries and self._entries[d].parent == key for d in deps), "dependents drifted"
        for member, group in self._group_of.items():
            assert member in self._entries[group].members and member not in self._entries, "members drifted"
        assert +self._by_kind == +_sum_by_kind(self._entries.values()), "bytes by kind drifted"
        assert +self._count == +Counter(e.kind for e in self._entries.values()), "entries by kind drifted"

    # ----------------------------------------------------------------- internals
    def _add(self, key: str, entry: _Entry) -> None:
        self._entries[key] = entry
        self._by_kind[entry.kind] += entry.size
        self._count[entry.kind] += 1
        if entry.kind == "foreign":
            self._foreign[key] = None  # never used here: before every entry of ours
        elif entry.kind in EVICTABLE:
            self._lru[key] = None
        if entry.parent is not None:
            self._dependents.setdefault(entry.parent, set()).add(key)

    def _set_size(self, key: str, entry: _Entry, size: int) -> None:
        self._used += size - entry.size
        self._by_kind[entry.kind] += size - entry.size
        entry.size = size

    def _remove_locked(self, key: str) -> list[Victim]:
        entry = self._entries.pop(key)
        self._by_kind[entry.kind] -= entry.size
        self._count[entry.kind] -= 1
        self._lru.pop(key, None)
        self._foreign.pop(key, None)
        self._used -= entry.size
        out = [Victim(key, entry.size, entry.kind)]
        if entry.parent is not None:
            deps = self._dependents.get(entry.parent)
            if deps is not None:
                deps.discard(key)
                if not deps:
                    del self._dependents[entry.parent]
        for dep in sorted(self._dependents.pop(key, ())):
            out.extend(self._remove_locked(dep))
        for member in entry.members:
            if self._group_of.get(member) == key:
                del self._group_of[member]
        return out

    def _is_pinned(self, key: str, entry: _Entry) -> bool:
        if entry.kind == "group":
            return any(self._pinned(m) for m in entry.members)
        if entry.kind == "activation":
            return self._pinned(entry.parent)
        return entry.kind != "foreign" and self._pinned(key)

    def _make_room(self, size: int, keep: set[str]) -> Optional[tuple[Victim, ...]]:
        """Victims that make `size` more bytes fit, removed; None (nothing removed) if the candidates cannot."""
        need = self._used + size - self.capacity
        if need <= 0:
            return ()
        picked = self._pick(need, keep, best_effort=False)
        return None if picked is None else tuple(picked)

    def _pick(self, need: int, keep: set[str], *, best_effort: bool) -> Optional[list[Victim]]:
        chosen: list[str] = []
        freed = 0
        for key in chain(self._foreign, self._lru):  # the one order: foreign files, then least recently used
            if freed >= need:
                break
            entry = self._entries[key]
            if key in keep or self._is_pinned(key, entry):
                continue
            chosen.append(key)
            freed += entry.size + sum(self._entries[d].size for d in self._dependents.get(key, ()))
        if freed < need and not best_effort:
            return None
        victims: list[Victim] = []
        for key in chosen:
            victims.extend(self._remove_locked(key))
        return victims


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown entry kind {kind!r}; expected one of {KINDS}")


def _sum_by_kind(entries: Iterable[_Entry]) -> Counter[str]:
    out: Counter[str] = Counter()
    for e in entries:
        out[e.kind] += e.size
    return out
