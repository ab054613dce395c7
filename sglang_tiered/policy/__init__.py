"""Decisions from measured costs, pure (no SGLang, no engine): `placement.py` (which radix nodes leave device and
host memory first), `partition.py` (KV-Runahead split search and lookup table), `loading.py` (the blend recompute
ratio), `cpu_dtype.py` (the fastest prefill dtype of this CPU). The engine and the integration import policy;
policy imports neither."""
