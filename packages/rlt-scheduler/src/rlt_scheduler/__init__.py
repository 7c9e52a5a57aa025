"""Loop-level request scheduling, exit policies and admission for looped transformers."""
