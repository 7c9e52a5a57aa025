"""The other process of the real-NIXL tests: a `KVTransport` (and a `KVReceiver` when asked)
over small CPU tensors shaped like the runner's, driven by commands over a multiprocessing pipe.

Commands are (name, kwargs); replies are ("ok", value) or ("error", type name, message), so the
test process can assert on the peer's exceptions. Shared geometry helpers live here too.
"""

from __future__ import annotations

import time
import traceback

# Geometry of the test tensors: [L, A, B, Hkv, D] fp16 with A = NUM_BLOCKS + 1 (scratch).
LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM, ROWS, HIDDEN = 2, 8, 16, 1, 4, 4, 8


def compatibility(**changes):
    from rlt_contracts.pd import PDCompatibility

    block = changes.get("block_size", BLOCK)
    fields = dict(
        model_identity="test-model:1",
        num_layers=LAYERS,
        num_loops=2,
        kv_layout="last_exited",
        dtype="float16",
        block_size=block,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        block_bytes=2 * block * HEADS * HEAD_DIM * 2,
        hidden_bytes=HIDDEN * 2,
    )
    fields.update(changes)
    return PDCompatibility(**fields)


def tensors(seed: int | None, block_size: int = BLOCK):
    """K, V [L, A, B, Hkv, D] and hidden [S, d], fp16, random (seeded) or zeros."""
    import torch

    shape = (LAYERS, NUM_BLOCKS + 1, block_size, HEADS, HEAD_DIM)
    if seed is None:
        return (
            torch.zeros(shape, dtype=torch.float16),
            torch.zeros(shape, dtype=torch.float16),
            torch.zeros(ROWS, HIDDEN, dtype=torch.float16),
        )
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(shape, generator=g).half(),
        torch.randn(shape, generator=g).half(),
        torch.randn(ROWS, HIDDEN, generator=g).half(),
    )


def memory_of(key, value, hidden, scratch_blocks: int = 1):
    """The `PDMemory` a runner declares for these contiguous tensors (rlt-runner's
    `pd_regions.pd_memory`, which this package's tests may not import)."""
    from rlt_contracts import HiddenRowsMemory, KVPoolMemory, MemoryRegion, PDMemory

    def region(tensor):
        assert tensor.is_contiguous()
        size = tensor.numel() * tensor.element_size()
        return MemoryRegion(tensor.data_ptr(), size, tensor.device.type, tensor.device.index or 0)

    layers, allocated, block, heads, head_dim = key.shape
    dtype = str(key.dtype).removeprefix("torch.")
    kv = KVPoolMemory(
        region(key), region(value), layers, allocated, scratch_blocks, block, heads, head_dim,
        dtype, key.element_size(), num_planes=2,
    )  # fmt: skip
    row_bytes = hidden.shape[1] * hidden.element_size()
    return PDMemory(kv, HiddenRowsMemory(region(hidden), hidden.shape[0], row_bytes, dtype))


def transport(name: str, tensors, compat):
    """A `KVTransport` over `tensors` (K, V, hidden), which it keeps alive while registered."""
    from rlt_pd.transport import KVTransport

    return KVTransport(name, memory_of(*tensors), compat, owner=tensors)


class _Peer:
    def __init__(self) -> None:
        self.transport = None
        self.receiver = None
        self.tensors = None

    def init(self, name: str, seed: int | None, compat: dict):
        self.tensors = tensors(seed, compat.get("block_size", BLOCK))
        self.transport = transport(name, self.tensors, compatibility(**compat))
        return self.transport.metadata()

    def metadata(self):
        return self.transport.metadata()

    def connect(self, metadata: bytes):
        return self.transport.connect(metadata)

    def snapshot(self):
        return tuple(t.clone() for t in self.tensors)

    def wait_notifications(self, count: int, timeout: float = 10.0):
        """(peer, message) pairs once `count` arrived, each with the tensors as they were right
        after its arrival (a notification must mean its bytes already landed)."""
        from rlt_pd import decode_message

        got = []
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            for peer, raw in self.transport.notifications():
                got.append((peer, decode_message(raw), self.snapshot()))
            time.sleep(0.0005)
        return got

    def expect(self, target: bytes, prefill_agent: str, wait_timeout_s: float = 30.0):
        import msgspec
        from rlt_contracts.pd import HandoffTarget
        from rlt_pd import KVReceiver, ReceiverConfig

        if self.receiver is None:
            self.receiver = KVReceiver(self.transport, ReceiverConfig(wait_timeout_s, 30.0))
        self.receiver.expect(msgspec.msgpack.decode(target, type=HandoffTarget), prefill_agent)

    def poll_receiver(self, until: int = 1, timeout: float = 10.0, cancel: str | None = None):
        """Poll the receiver until `until` events were reported (optionally cancelling first)."""
        if cancel is not None:
            self.receiver.cancel(cancel)
        events = []
        deadline = time.monotonic() + timeout
        while len(events) < until and time.monotonic() < deadline:
            events += [tuple(e) for e in self.receiver.poll()]
            time.sleep(0.0005)
        return events

    def close(self):
        self.transport.close()
        self.transport.close()  # idempotent
        return self.transport.closed


def serve(conn) -> None:
    peer = _Peer()
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            return
        if command == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(peer, command)(**kwargs)))
        except Exception as error:
            conn.send(("error", type(error).__name__, f"{error}\n{traceback.format_exc()}"))
