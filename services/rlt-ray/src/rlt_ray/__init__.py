"""rlt on Ray Serve (placeholder, filled in below)."""
