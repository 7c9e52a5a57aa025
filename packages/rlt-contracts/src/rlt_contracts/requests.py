"""Request identity, lifecycle stages and finish reasons."""

from __future__ import annotations

import enum

import msgspec


class FinishReason(enum.StrEnum):
    """Why a request stopped. Serializes to the public strings "stop", "length", "abort"."""

    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller, or failed inside the engine


class RequestStage(enum.StrEnum):
    """Logical progress of one request, owned and advanced by the scheduler.

    WAITING    queued, holds no KV blocks (or preempted: its device state lives in a snapshot).
    PREFILL    prompt chunks run at full depth; the last prompt position goes straight to coda.
    PRELUDE    a sampled token waits to be embedded for its first loop.
    RECURRENT  the current token is between loops; the next loop runs in a later step.
    CODA       the current token has exited; the LM head and sampler run next.
    FINISHED   done; every resource is released.
    """

    WAITING = "waiting"
    PREFILL = "prefill"
    PRELUDE = "prelude"
    RECURRENT = "recurrent"
    CODA = "coda"
    FINISHED = "finished"


class ExecutionIdentity(msgspec.Struct, frozen=True, array_like=True):
    """One admission of one request: the external id plus an engine-unique generation number.

    An external `request_id` may be reused after the request finished or was aborted. Every
    scheduled item and every execution result carries the identity, and results whose identity
    is not the current one are dropped, so late results never reach a new request (R17).
    """

    request_id: str
    generation: int
