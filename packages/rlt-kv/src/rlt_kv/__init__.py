"""Logical paged KV-cache management with per-depth block tables."""
