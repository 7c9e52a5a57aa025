"""Prefill/decode disaggregation: handoff planning and KV transfer."""
