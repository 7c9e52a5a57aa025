"""The engine core's messages survive msgpack, and typed errors cross the boundary as the
same `RltError` classes with their fields."""

from __future__ import annotations

import msgspec
import pytest
from rlt_contracts import (
    CapacityError,
    ConfigurationError,
    CoreAbort,
    CoreAdd,
    CoreInput,
    CoreOutputs,
    CoreReply,
    EngineDeadError,
    EngineRequest,
    FinishReason,
    InvalidRequestError,
    OverloadedError,
    RequestOutputDelta,
    RltError,
    SamplingParams,
    WireError,
    raise_wire_error,
)


def test_inputs_and_outputs_round_trip_through_msgpack():
    request = EngineRequest("r", (1, 2, 3), SamplingParams(max_tokens=4, stop=("x",)))
    for message in (CoreAdd(7, (request,)), CoreAbort(("r",), FinishReason.STOP)):
        wire = msgspec.msgpack.encode(message)
        assert msgspec.msgpack.decode(wire, type=CoreInput) == message
    outputs = CoreOutputs(
        deltas=(
            RequestOutputDelta(
                request_id="r",
                token_ids=(5,),
                exit_depths=(3,),
                finished=True,
                finish_reason="length",
            ),
        ),
        replies=(CoreReply(7, None, [["agent"], [], []]),),
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=CoreOutputs) == outputs


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequestError("top_p", "must be in (0, 1]"),
        CapacityError("max_tokens", "too long"),
        ConfigurationError(("host", "port"), "cannot listen"),
        OverloadedError("the waiting queue is full"),
        EngineDeadError("gone"),
    ],
)
def test_typed_errors_are_raised_again_as_themselves(error):
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(WireError.of(error)), type=WireError)
    with pytest.raises(type(error)) as raised:
        raise_wire_error(wire)
    assert str(raised.value) == str(error)
    assert type(raised.value) is type(error)


class _PackageConfigError(ConfigurationError):
    """As rlt-models' ModelConfigError: another package's subclass of a contracts error."""


class _PackageError(RltError, ValueError):
    """As rlt-models' CheckpointError: another package's direct RltError subclass."""


def test_another_packages_subclass_arrives_as_the_contracts_class_with_its_fields():
    error = _PackageConfigError("config.json", "not found in /models/x")
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(WireError.of(error)), type=WireError)
    with pytest.raises(ConfigurationError) as raised:
        raise_wire_error(wire)
    assert raised.value.options == ("config.json",)
    assert str(raised.value) == str(error) == "config.json: not found in /models/x"
    with pytest.raises(RltError, match=r"^_PackageError: model.safetensors: missing$"):
        raise_wire_error(WireError.of(_PackageError("model.safetensors: missing")))


def test_an_untyped_error_arrives_as_rlt_error_naming_it():
    with pytest.raises(RltError, match="ValueError"):
        raise_wire_error(WireError.of(ValueError("boom")))
