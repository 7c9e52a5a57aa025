"""Control-message codec, handshake metadata and the compatibility check (pure, no NIXL)."""

from __future__ import annotations

import msgspec
import pytest
from rlt_contracts import RltError
from rlt_contracts.pd import PDCompatibility
from rlt_pd import (
    PROTOCOL_VERSION,
    Cancel,
    Commit,
    Drained,
    HandoffProtocolError,
    KVRegion,
    Landed,
    PDCompatibilityError,
    TransportMetadata,
    check_compatibility,
    decode_message,
    encode_message,
)

COMPAT = PDCompatibility(
    "ouro-1.4b:abc", 24, 4, "last_exited", "bfloat16", 16, 16, 128, 131072, 4096
)
REGION = KVRegion.contiguous(
    num_layers=24, num_blocks=100, block_size=16, num_kv_heads=16, head_dim=128, dtype_bytes=2,
    allocated_blocks=101,
)  # fmt: skip


def metadata(name="P", compat=COMPAT, region=REGION, version=PROTOCOL_VERSION):
    return TransportMetadata(
        version=version,
        name=name,
        agent_metadata=b"\x00nixl",
        compatibility=compat,
        memory="VRAM",
        device_id=0,
        key_address=1 << 40,
        value_address=2 << 40,
        hidden_address=3 << 40,
        region=region,
        allocated_blocks=101,
        hidden_rows=64,
        hidden_row_stride_bytes=4096,
    )


@pytest.mark.parametrize(
    "message", [Landed("t-1", 0), Landed("t", 2**40), Commit("t", 7), Cancel("x"), Drained("y")]
)
def test_messages_round_trip(message):
    assert decode_message(encode_message(message)) == message


def test_wire_format_is_a_tagged_msgpack_map():
    assert msgspec.msgpack.decode(encode_message(Landed("t1", 3))) == {
        "kind": "landed",
        "transfer_id": "t1",
        "sequence": 3,
    }
    assert len(encode_message(Landed("t1", 3))) < 40  # small enough for a notification


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"kind": "landed", "transfer_id": "t"}),  # missing field
        msgspec.msgpack.encode({"kind": "ack", "transfer_id": "t"}),  # unknown kind
        msgspec.msgpack.encode({"kind": "commit", "transfer_id": "t", "count": "3"}),
    ],
)
def test_undecodable_messages_are_protocol_errors(raw):
    with pytest.raises(HandoffProtocolError, match="undecodable"):
        decode_message(raw)


def test_metadata_round_trips():
    meta = metadata()
    assert TransportMetadata.decode(meta.encode()) == meta
    with pytest.raises(PDCompatibilityError, match="does not decode"):
        TransportMetadata.decode(b"garbage")


def test_compatible_peers_pass():
    other_pool = KVRegion.contiguous(
        num_layers=24, num_blocks=7, block_size=16, num_kv_heads=16, head_dim=128, dtype_bytes=2
    )
    check_compatibility(metadata("P"), metadata("D", region=other_pool))  # pool sizes may differ


def test_every_mismatching_field_is_named():
    theirs = msgspec.structs.replace(
        COMPAT, block_size=32, dtype="float16", model_identity="other", hidden_bytes=2048
    )
    with pytest.raises(PDCompatibilityError) as caught:
        check_compatibility(metadata("P"), metadata("D", compat=theirs, version=99))
    text = str(caught.value)
    assert isinstance(caught.value, RltError)
    assert "'P' to 'D'" in text
    for expected in (
        "protocol version: 1 here, 99 there",
        "block_size: 16 here, 32 there",
        "dtype: 'bfloat16' here, 'float16' there",
        "model_identity: 'ouro-1.4b:abc' here, 'other' there",
        "hidden_bytes: 4096 here, 2048 there",
    ):
        assert expected in text
    for same in ("num_layers", "num_loops", "kv_layout", "head_dim", "block_bytes"):
        assert f"{same}:" not in text


def test_geometry_mismatch_behind_equal_compatibility_is_refused():
    region = KVRegion.contiguous(
        num_layers=24, num_blocks=100, block_size=16, num_kv_heads=8, head_dim=256, dtype_bytes=2
    )
    with pytest.raises(PDCompatibilityError, match="KV tensors' num_kv_heads: 16 here, 8 there"):
        check_compatibility(metadata("P"), metadata("D", region=region))
