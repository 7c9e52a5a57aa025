"""Attention backends (paged, depth-aware) with declared capabilities and selection."""
