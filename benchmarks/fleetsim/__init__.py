"""A discrete-event simulation of an rlt fleet, driven by curves measured on one H200.

Modules, one concept each: `curves` (what one instance's steps cost), `cache` (a prefix cache
with LRU eviction), `instance` (one engine's continuous batching, step by step), `traces`
(multi-turn chat and random requests), `routers` (round robin, least loaded, prefix affinity),
`fleet` (the event loop) and `metrics` (latency percentiles and the SLO). The command line is
`benchmarks/fleet_sim.py`; the method and its limits are in docs/scale.md.
"""
