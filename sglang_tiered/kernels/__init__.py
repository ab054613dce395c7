"""Compute: torch reference paths (and, later, GPU fast paths with the same signatures)."""
