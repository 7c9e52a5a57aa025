"""Executor, worker and model runner: device state, KV storage and batch execution."""
