"""Independent oracles for tests: literal re-statements of the model spec, sharing no code with
the runtime (they read checkpoints with safetensors directly)."""
