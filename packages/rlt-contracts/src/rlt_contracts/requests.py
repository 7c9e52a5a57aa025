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
    DECODING   the prompt is done; the request's tokens loop on the device under the decode rule
               the scheduler handed over (loop progress and exit state live in device state).
    AWAITING_KV  PD decode instance: admitted, its prompt's KV (and final hidden state) are being
               written by a prefill instance; it decodes once every write has landed.
    SENDING_KV   PD prefill instance: the prompt is computed; its KV is being pushed to the decode
               instance; it finishes when every write completed.
    FINISHED   done; every resource is released.
    """

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODING = "decoding"
    AWAITING_KV = "awaiting_kv"
    SENDING_KV = "sending_kv"
    FINISHED = "finished"


class ExecutionIdentity(msgspec.Struct, frozen=True, array_like=True):
    """One admission of one request: the external id plus an engine-unique generation number.

    An external `request_id` may be reused after the request finished or was aborted. Every
    scheduled item and every execution result carries the identity, and results whose identity
    is not the current one are dropped, so late results never reach a new request (R17).
    """

    request_id: str
    generation: int
