"""The one failure of a stored span's reader: the span, or a page, group or chunk of it, cannot be served.

A module of its own so that a page source needs only this, not the store (`group_span` imports the store's group
files and checksum, hence zlib-ng): `engine.meet`, `engine.page_span` and `engine.group_span` raise it, the door
(`integration.door`) turns it into a counted fallback to SGLang.
"""


class SpanMiss(RuntimeError):
    """A stored span (or part of it) could not be read: the caller falls back to computing the span."""
