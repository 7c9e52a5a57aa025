"""`PDMemory`: a declaration is refused unless its sizes match its layout; offsets follow the
row-major [L, A, B, Hkv, D] layout the module doc gives."""

from __future__ import annotations

import msgspec
import pytest
from rlt_contracts import HiddenRowsMemory, KVPoolMemory, MemoryRegion, PDMemory

# [L, A, B, Hkv, D] = [2, 5, 4, 3, 8] bf16: one block of one layer is 4 * 3 * 8 * 2 = 192 bytes
GEOMETRY = dict(
    num_layers=2, allocated_blocks=5, scratch_blocks=1, block_size=4, num_kv_heads=3,
    head_dim=8, dtype="bfloat16", element_bytes=2, num_planes=3,
)  # fmt: skip
SIZE = 2 * 5 * 192


def pool(**changes) -> KVPoolMemory:
    fields = dict(key=MemoryRegion(4096, SIZE, "cpu"), value=MemoryRegion(65536, SIZE, "cpu"))
    return KVPoolMemory(**{**fields, **GEOMETRY, **changes})


def test_offsets_and_sizes_follow_the_layout():
    kv = pool(stage_plane=2)
    assert (kv.token_bytes, kv.block_bytes, kv.num_blocks) == (48, 192, 4)
    assert kv.offset_bytes(0, 0) == 0
    assert kv.offset_bytes(1, 3, 2) == (1 * 5 + 3) * 192 + 2 * 48
    hidden = HiddenRowsMemory(MemoryRegion(8192, 3 * 64, "cpu"), 3, 64, "bfloat16")
    assert hidden.row_address(2) == 8192 + 128
    memory = PDMemory(kv, hidden)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(memory), type=PDMemory) == memory


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(key=MemoryRegion(4096, SIZE - 1, "cpu")), "key allocation holds"),
        (dict(value=MemoryRegion(4096, SIZE, "cuda")), "different devices"),
        (dict(scratch_blocks=5), "scratch_blocks 5 of 5"),
        (dict(stage_plane=1), "the stage plane is the last"),
    ],
)
def test_a_declaration_that_contradicts_itself_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        pool(**changes)


def test_hidden_rows_and_regions_are_checked():
    with pytest.raises(ValueError, match="192 bytes for 2 rows of 64"):
        HiddenRowsMemory(MemoryRegion(8192, 192, "cpu"), 2, 64, "bfloat16")
    with pytest.raises(ValueError, match="only cpu and cuda"):
        MemoryRegion(8192, 64, "mps")
    hidden = HiddenRowsMemory(MemoryRegion(8192, 128, "cuda", 1), 2, 64, "bfloat16")
    with pytest.raises(ValueError, match="row 2 not in"):
        hidden.row_address(2)
    with pytest.raises(ValueError, match="different devices"):
        PDMemory(pool(), hidden)
