"""The exit code of `rlt serve` when its engine core died (the server's options are
`rlt_serve.front_options.ServeOptions`)."""

EXIT_ENGINE_DIED = 1
