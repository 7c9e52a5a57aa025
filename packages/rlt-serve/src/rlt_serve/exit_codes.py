"""Exit codes of the `rlt` commands, one per kind of outcome, the same for `rlt generate`,
`rlt serve` (any number of front ends), `rlt pd serve` and `rlt bench serve`
(docs/configuration.md, Exit codes)."""

from __future__ import annotations

EXIT_OK = 0  # done; for a server: stopped by SIGINT / SIGTERM after its drain
# failed while running: the engine core or a PD instance died, an instance never became
# healthy, or `rlt bench serve` saw no request succeed
EXIT_FAILURE = 1
# refused before starting: a bad command line or configuration (argparse's own code), a port
# outside 0..65535 or taken, an incomplete or unreadable model directory, a Hugging Face model
# id that cannot be resolved (rlt_models.model_source)
EXIT_USAGE = 2
# + a signal's number: a second signal cut a server's drain short, or Ctrl-C interrupted a
# benchmark (130 for SIGINT, 143 for SIGTERM)
FORCED_EXIT_BASE = 128
