"""rlt: inference and serving runtime for recurrent looped transformers (Ouro)."""

__version__ = "0.1.0"
