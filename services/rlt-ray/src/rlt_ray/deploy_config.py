"""`serve run` / `serve deploy` config files (`import_path: rlt_ray:app_builder`): a config's
`args` are `rlt ray serve` flags by name, parsed and checked exactly like the command line
(`rlt_ray.cli`), then built into the application (`rlt_ray.app.build_app`)."""

from __future__ import annotations

import shlex
from typing import Any

from rlt_ray.app import build_app


def app_builder(args: dict[str, Any]):
    """`serve run` / `serve deploy` entry point (`import_path: rlt_ray:app_builder`): `args`
    holds `rlt ray serve` flags by name (`replicas: 2`, `enable_prefix_caching: true`, `model:
    /models/ouro-1.4b`, ...) or one `argv` string; they are parsed and checked exactly like
    the command line."""
    # the parser's module (argparse, the command's runner) only when a config is built:
    # importing rlt_ray stays light
    from rlt_ray.cli import build_parser, options_from_args

    args = dict(args or {})
    argv = shlex.split(args.pop("argv", ""))
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    parsed = build_parser().parse_args(["serve", *argv])
    config, serve_options, options, _ = options_from_args(parsed)
    return build_app(config, serve_options, options)
