"""The options of `rlt pd serve`, each field one flag (rlt_contracts.options,
rlt_serve.option_flags; cli.py builds them): `CoordinatorOptions`, everything the command
takes, and `CoordinationOptions`, the coordinator's credits and timeouts, declared once for
both commands that run a coordinator (`CoordinatorOptions.coordination`; `rlt ray pd serve`:
rlt-ray's `PDOptions.coordination`)."""

from __future__ import annotations

import shlex
from typing import Annotated

import msgspec
from rlt_contracts import ConfigurationError, Option
from rlt_contracts.pd import PDRole
from rlt_serve.front_options import LOG_LEVELS, FrontOptions
from rlt_serve.vllm_flags import FrontSettings

from rlt_pd_coordinator.client import Timeouts
from rlt_pd_coordinator.cluster import Instance
from rlt_pd_coordinator.supervisor import DEFAULT_COMMAND


class CoordinationOptions(msgspec.Struct, frozen=True, kw_only=True):
    """PD coordinator: credits and timeouts

    A credit is one request in flight on an instance (`Cluster`); `timeouts`: what
    `PDEngineClient` waits for (admission, transfer).
    """

    prefill_credits: Annotated[int, Option("most requests in flight per prefill instance")] = 32
    decode_credits: Annotated[int, Option("most requests in flight per decode instance")] = 128
    admission_timeout: Annotated[
        float,
        Option("seconds for a decode instance to admit a request (its handoff target)"),
    ] = 60.0
    transfer_timeout: Annotated[
        float, Option("seconds from the prefill call to the decode instance's first token")
    ] = 120.0
    credit_wait: Annotated[
        float, Option("seconds a request waits for a free credit before HTTP 429")
    ] = 30.0
    poll_interval: Annotated[
        float, Option("seconds between load / health polls of each instance")
    ] = 1.0

    def __post_init__(self) -> None:
        for name, least in (("prefill_credits", 1), ("decode_credits", 1), ("credit_wait", 0)):
            if getattr(self, name) < least:
                raise ConfigurationError(name, f"must be >= {least}, got {getattr(self, name)}")
        for name in ("admission_timeout", "transfer_timeout", "poll_interval"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(name, f"must be > 0, got {getattr(self, name)}")

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts(admission=self.admission_timeout, transfer=self.transfer_timeout)


class CoordinatorOptions(FrontOptions, frozen=True, kw_only=True):
    """instances: prefill/decode, or the plain router's replicas (the colocated baseline)

    Everything `rlt pd serve` takes, each option one flag (cli.py): the front's options
    (`FrontOptions`, rlt serve's too), the instances and how they are reached and started, and
    the coordinator's credits and timeouts (`CoordinationOptions`, rlt ray pd serve's too).
    """

    # checkpoint directory or Hugging Face model id (tokenizer, config); None: the bundled one
    model: str | None = None
    revision: str | None = None  # with a model id: the branch, tag or commit (None: main)
    download_dir: str | None = None  # with a model id: the Hugging Face cache to use
    mode: str = "pd"  # "pd" or "router"
    num_prefill: Annotated[int, Option("local prefill instances to start")] = 0
    num_decode: Annotated[int, Option("local decode instances to start")] = 0
    prefill_urls: Annotated[
        tuple[str, ...],
        Option(
            "a running prefill instance (`rlt serve --pd-role prefill`; repeatable)",
            name="prefill_url",
            metavar="URL",
        ),
    ] = ()
    decode_urls: Annotated[
        tuple[str, ...],
        Option(
            "a running decode instance (`rlt serve --pd-role decode`; repeatable)",
            name="decode_url",
            metavar="URL",
        ),
    ] = ()
    replicas: Annotated[int, Option("local whole-engine replicas to start")] = 0
    replica_urls: Annotated[
        tuple[str, ...],
        Option(
            "a running colocated instance (`rlt serve`; repeatable)",
            name="replica_url",
            flags=("--url", "--replica-url"),
            metavar="URL",
        ),
    ] = ()
    replica_credits: Annotated[int, Option("most requests in flight per replica")] = 128
    # local children (--device: comma-separated lists are split by cli.py)
    devices: Annotated[
        tuple[str, ...],
        Option(
            "device of the local instances; several (comma-separated or repeated) are "
            "assigned round-robin: prefill instances first, then decode, then replicas",
            name="device",
        ),
    ] = ()
    command: Annotated[
        tuple[str, ...],
        Option(
            "command that runs one instance, MODEL and flags appended (default: "
            f"{' '.join(DEFAULT_COMMAND[1:])} with this Python)",
            name="engine_command",
            parse=shlex.split,
        ),
    ] = DEFAULT_COMMAND
    engine_args: tuple[str, ...] = ()
    instance_log_level: Annotated[LOG_LEVELS, Option("--log-level of the local instances")] = (
        "warning"
    )
    restart_delay: Annotated[
        float,
        Option(
            "seconds before restarting an instance that died (doubling on repeated "
            "failures, up to 30 s)"
        ),
    ] = 1.0
    startup_timeout: Annotated[float, Option("seconds an instance may take to answer /health")] = (
        600.0
    )
    stop_timeout: float = 15.0
    # instances
    instance_api_key: Annotated[
        str | None,
        Option(
            "API key of the instances (default: $RLT_INSTANCE_API_KEY, else --api-key; "
            "local instances get a random one when neither is set)",
            env="RLT_INSTANCE_API_KEY",
        ),
    ] = None
    connect_timeout: Annotated[float, Option("seconds to connect to an instance")] = 5.0
    coordination: CoordinationOptions = msgspec.field(default_factory=CoordinationOptions)
    # vLLM's flags: the tokenizer's directory or Hub id (front and local instances, which get
    # its directory; None: the model's),
    # and the front's --seed, --chat-template, TLS, uvicorn's log level, its access log
    tokenizer: str | None = None
    front: FrontSettings = msgspec.field(default_factory=FrontSettings)

    def instances(self) -> list[Instance]:
        """The local instances (named by role and index) then the listed URLs."""
        made: list[Instance] = []
        c = self.coordination
        groups = (
            (PDRole.PREFILL, self.num_prefill, self.prefill_urls, c.prefill_credits),
            (PDRole.DECODE, self.num_decode, self.decode_urls, c.decode_credits),
            (PDRole.NONE, self.replicas, self.replica_urls, self.replica_credits),
        )
        for role, count, urls, credits in groups:
            prefix = "replica" if role is PDRole.NONE else str(role)
            for index in range(count):
                made.append(Instance(f"{prefix}-{index}", role, "", credits, local=True))
            for index, url in enumerate(urls, start=count):
                made.append(Instance(f"{prefix}-{index}", role, url.rstrip("/"), credits))
        return made

    def check(self) -> None:
        pd = self.num_prefill or self.num_decode or self.prefill_urls or self.decode_urls
        router = self.replicas or self.replica_urls
        if pd and router:
            raise ConfigurationError(
                ("num_prefill/num_decode/prefill_url/decode_url", "replicas/url"),
                "run either prefill/decode instances or plain replicas, not both",
            )
        if self.mode == "pd":
            for role in ("prefill", "decode"):
                if not (getattr(self, f"num_{role}") or getattr(self, f"{role}_urls")):
                    raise ConfigurationError(
                        (f"num_{role}", f"{role}_url"), f"PD needs at least one {role} instance"
                    )
        elif not router:
            raise ConfigurationError(("replicas", "url"), "the router needs at least one replica")
        counts = (("num_prefill", 0), ("num_decode", 0), ("replicas", 0), ("replica_credits", 1))
        for name, least in counts:  # (prefill and decode credits: CoordinationOptions)
            if getattr(self, name) < least:
                raise ConfigurationError(name, f"must be >= {least}, got {getattr(self, name)}")
        for name in ("connect_timeout", "startup_timeout", "restart_delay"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(name, f"must be > 0, got {getattr(self, name)}")
        local = self.num_prefill + self.num_decode + self.replicas
        if (self.engine_args or self.devices) and not local:
            raise ConfigurationError(
                "engine flags",
                "engine flags (" + " ".join(self.engine_args or ("--device",)) + ") only apply "
                "to local instances, and none is started here",
            )
