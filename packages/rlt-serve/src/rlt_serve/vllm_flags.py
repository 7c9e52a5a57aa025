"""The flags vLLM users pass by habit, with vLLM's meaning where rlt has the capability and a
clear refusal where it does not (`rlt serve`, `rlt pd serve`, `rlt ray serve`; docs/serving.md,
"Flags from vLLM").

The HTTP front's (`add_front_arguments`; `FrontSettings`, what they make):
  --seed S: the seed of every request that gives none (its n sequences: S, S + 1, ...).
  --chat-template FILE|TEMPLATE: the Jinja chat template used instead of the tokenizer's.
  --ssl-keyfile / --ssl-certfile: serve HTTPS (uvicorn's TLS), checked before the model loads.
  --uvicorn-log-level: uvicorn's loggers only (its start lines and access log), never rlt's.
  --disable-log-requests: no per-request lines (uvicorn's access log).
The model's (`add_model_arguments`):
  --trust-remote-code: accepted; rlt never runs code from a checkpoint (its model families are
    its own code), so it changes nothing, and `note_trust_remote_code` says so in one line.
  --tensor-parallel-size / -tp N: 1 is accepted; above 1 `check_tensor_parallel` refuses it,
    naming what rlt has instead (replicas, fp8 weights and KV).
`--tokenizer` (the engine's: rlt.cli) and `--enforce-eager` (the engine's CUDA graphs) are the
engine command's own.
"""

from __future__ import annotations

import argparse
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlt_contracts import ConfigurationError
from rlt_contracts.sampling import MAX_SEED

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
TEMPLATE_MARKERS = ("{{", "{%")
TENSOR_PARALLEL_ADVICE = (
    "rlt runs each engine on one GPU and has no tensor parallelism; for more throughput run "
    "replicas (`rlt pd serve --replicas N` on one host, `rlt ray serve --replicas N` across "
    "hosts), for a model that does not fit one GPU store its weights and KV cache in fp8 "
    "(--quantization fp8 --kv-cache-dtype fp8)"
)
TRUST_REMOTE_CODE_NOTE = (
    "--trust-remote-code changes nothing: rlt never runs code from a checkpoint (every model "
    "family it serves is its own code)"
)


@dataclass(frozen=True)
class FrontSettings:
    """What the front's vLLM flags set (the defaults: none of them given).

    default_seed: the seed of requests that give none (None: each such request draws one).
    chat_template: the chat template's text, used instead of the tokenizer's (None: its own).
    ssl_keyfile / ssl_certfile: PEM files; with a certificate the server speaks HTTPS only.
    uvicorn_log_level: uvicorn's loggers' level (None: the server's --log-level).
    log_requests: uvicorn's access log, one line per request.
    """

    default_seed: int | None = None
    chat_template: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    uvicorn_log_level: str | None = None
    log_requests: bool = True

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def uvicorn_options(self, log_level: str) -> dict[str, Any]:
        """uvicorn.Config keywords: TLS, uvicorn's log level, its access log."""
        return {
            "log_level": self.uvicorn_log_level or log_level,
            "access_log": self.log_requests,
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_certfile": self.ssl_certfile,
        }


def add_front_arguments(group) -> None:
    group.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of every request that gives none, so unseeded requests repeat their "
        "outputs (default: none, each unseeded request draws its own)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="Jinja chat template (a file, or the template itself) used instead of the "
        "tokenizer's (default: the tokenizer's own)",
    )
    group.add_argument(
        "--ssl-keyfile",
        default=None,
        metavar="FILE",
        help="TLS private key (PEM) of --ssl-certfile (default: none; the key may also be in "
        "the certificate file)",
    )
    group.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="FILE",
        help="TLS certificate chain (PEM): serve HTTPS instead of HTTP (default: none, HTTP)",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=UVICORN_LOG_LEVELS,
        help="level of uvicorn's own log lines (start, access log), not rlt's (default: "
        "--log-level)",
    )
    group.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no log line per request (uvicorn's access log) (default: one per request)",
    )


def add_model_arguments(group) -> None:
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's command lines; rlt never runs checkpoint code, so it "
        "changes nothing (default: off)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="GPUs one engine spans: only 1 (one engine per GPU; replicas scale out)",
    )


def front_settings_from_args(args: argparse.Namespace) -> FrontSettings:
    """The settings of the parsed front flags, checked (a `ConfigurationError` naming the flag:
    before anything loads)."""
    check_tls_files(args.ssl_keyfile, args.ssl_certfile)
    if args.seed is not None and not 0 <= args.seed < MAX_SEED:
        raise ConfigurationError("seed", f"must be in [0, 2**63), got {args.seed}")
    return FrontSettings(
        default_seed=args.seed,
        chat_template=read_chat_template(args.chat_template),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        uvicorn_log_level=args.uvicorn_log_level,
        log_requests=not args.disable_log_requests,
    )


def check_model_arguments(args: argparse.Namespace) -> None:
    """--tensor-parallel-size refused above 1; the --trust-remote-code note."""
    check_tensor_parallel(args.tensor_parallel_size)
    if args.trust_remote_code:
        note_trust_remote_code()


def check_tensor_parallel(size: int) -> None:
    if size < 1:
        raise ConfigurationError("tensor_parallel_size", f"must be >= 1, got {size}")
    if size > 1:
        raise ConfigurationError(
            "tensor_parallel_size", f"{size} GPUs per engine: {TENSOR_PARALLEL_ADVICE}"
        )


def note_trust_remote_code(prog: str = "rlt") -> None:
    print(f"{prog}: note: {TRUST_REMOTE_CODE_NOTE}", file=sys.stderr, flush=True)


def read_chat_template(value: str | None) -> str | None:
    """--chat-template's text: a file's content, or the value itself when it is a Jinja
    template (whether it compiles is checked with the tokenizer: `rlt_serve.build_app`)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError("chat_template", f"cannot read {path}: {exc}") from None
    elif any(marker in value for marker in TEMPLATE_MARKERS):
        template = value
    else:
        raise ConfigurationError(
            "chat_template",
            f"{value!r} is neither a file nor a Jinja template (no '{{{{' or '{{%' in it)",
        )
    return template


def check_tls_files(keyfile: str | None, certfile: str | None) -> None:
    """The certificate (and key) load as uvicorn will load them; else a `ConfigurationError`
    naming the flag, before the model loads instead of after."""
    if keyfile is not None and certfile is None:
        raise ConfigurationError(
            ("ssl_keyfile", "ssl_certfile"), "--ssl-keyfile needs --ssl-certfile (the certificate)"
        )
    if certfile is None:
        return
    for flag, name in (("ssl_certfile", certfile), ("ssl_keyfile", keyfile)):
        if name is not None and not Path(name).is_file():
            raise ConfigurationError(flag, f"{name!r} is not a file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigurationError(
            ("ssl_certfile", "ssl_keyfile"), f"cannot load the certificate and its key: {exc}"
        ) from None
