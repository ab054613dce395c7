"""Policy from measured costs (no SGLang): `partition.py` (KV-Runahead partition search and lookup table)."""
