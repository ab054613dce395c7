"""Layer-by-layer execution over a Llama-family model (no SGLang): `llama.py` (the model and its per-layer steps),
`parallel_prefill.py` (chained prefill across ranks and the sequence-parallel baseline), `ranks.py` (spawning local
ranks for tests, tuning and benchmarks)."""
