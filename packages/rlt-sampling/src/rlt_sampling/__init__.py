"""Token sampling: greedy, temperature, top-k, top-p with per-request generators."""
