"""`KVTransport`: one NIXL agent (UCX backend) per engine, over the runner's KV pool and
hidden-state rows. Implements `rlt_pd.transport_api.Transport` for the connectors.

README.md, "Transport", gives the registered memory, the handshake, how a partition is posted
as one NIXL transfer (prepared indices or explicit descriptors) and what completion means.
Failures never raise from `write`/`poll`: they become failed handles with the reason.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from rlt_contracts.pd import PDCompatibility
from rlt_contracts.pd_memory import PDMemory

from rlt_pd import descriptors
from rlt_pd.descriptors import MemoryExtent
from rlt_pd.handoff import TransferPartition
from rlt_pd.messages import (
    PROTOCOL_VERSION,
    ControlMessage,
    PDTransportError,
    TransportMetadata,
    check_compatibility,
    encode_message,
)
from rlt_pd.nixl_agent import DEFAULT_PROGRESS_DELAY_US, make_agent
from rlt_pd.region import KVRegion
from rlt_pd.transport_api import TransportPoll

__all__ = ["KVTransport"]

log = logging.getLogger(__name__)


@dataclass
class _Peer:
    meta: TransportMetadata
    extent: MemoryExtent
    remote_dlist: object  # nixl_prepped_dlist_handle


@dataclass
class _Write:
    peer: str
    xfer: object  # nixl_xfer_handle


def _as_str(name: bytes | str) -> str:
    return name.decode() if isinstance(name, bytes) else name


class KVTransport:
    """NIXL endpoint of one engine (P or D). Not thread-safe: call it from one thread.

    name: unique among the engines that connect to each other. memory: the runner's declared
    KV pool and hidden rows, which `compatibility`'s geometry must describe (ValueError);
    `owner` keeps it allocated until `close()`. backend_params: UCX parameters over NIXL's
    defaults. progress_delay_us: `rlt_pd.nixl_agent` (README.md, "Its agent's thread").
    """

    def __init__(
        self,
        name: str,
        memory: PDMemory,
        compatibility: PDCompatibility,
        *,
        owner: object = None,
        backend_params: dict[str, str] | None = None,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
    ) -> None:
        descriptors.check_memory(memory, compatibility)
        kv = memory.kv
        self._name = name
        self._compatibility = compatibility
        self._owner = owner  # kept alive while registered
        self._extent = MemoryExtent.of_memory(memory)
        self._memory = "VRAM" if kv.key.device == "cuda" else "DRAM"
        self._allocated = kv.allocated_blocks
        self._region = KVRegion.contiguous(
            num_layers=kv.num_layers,
            num_blocks=kv.num_blocks,
            block_size=kv.block_size,
            num_kv_heads=kv.num_kv_heads,
            head_dim=kv.head_dim,
            dtype_bytes=kv.element_bytes,
            allocated_blocks=kv.allocated_blocks,
        )
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[int, _Write] = {}
        self._completed: list[int] = []
        self._failed: list[tuple[int, str]] = []
        self._handles = itertools.count()
        self._closed = False
        self._posted = {"prepped": 0, "explicit": 0}

        try:
            agent = make_agent(name, progress_delay_us)
            plugins = agent.get_plugin_list()
            if "UCX" not in plugins:
                raise PDTransportError(f"NIXL has no UCX plugin here (plugins: {plugins})")
            agent.create_backend(
                "UCX", {**agent.get_plugin_params("UCX"), **(backend_params or {})}
            )
        except PDTransportError:
            raise
        except Exception as error:
            raise PDTransportError(f"cannot create NIXL agent {name!r}: {error!r}") from error
        self._agent = agent
        self._registration = None
        self._local_dlist = None
        try:
            regions = (("key", kv.key), ("value", kv.value), ("hidden", memory.hidden.region))
            registration = agent.register_memory(
                [(r.address, r.size_bytes, r.device_index, label) for label, r in regions],
                self._memory,
            )
            if registration is None:  # NIXL only logs; never silently continue
                raise PDTransportError("NIXL refused to describe the memory for registration")
            self._registration = registration
            self._local_dlist = agent.prep_xfer_dlist(
                "", descriptors.prepared_table(self._extent), self._memory
            )
        except Exception as error:
            self.close()
            if isinstance(error, PDTransportError):
                raise
            raise PDTransportError(f"cannot register KV memory with NIXL: {error!r}") from error

    # -- description ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def region(self) -> KVRegion:
        return self._region

    @property
    def hidden_state_bytes(self) -> int:
        return self._extent.hidden_row_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    @property
    def inflight(self) -> int:
        """Writes posted and not yet reported by poll()."""
        return len(self._inflight)

    @property
    def posted(self) -> dict[str, int]:
        """Writes handed to NIXL so far, by path: {"prepped": n, "explicit": m}."""
        return dict(self._posted)

    def prepared_indices(
        self, peer: str, partition: TransferPartition, hidden_rows: tuple[int, int] | None = None
    ) -> tuple[list[int], list[int]] | None:
        """(local, remote) indices into the prepared lists that `write` would use for this
        partition, or None when it goes as explicit descriptors (a token-exact range)."""
        return descriptors.prepared_indices(
            partition, hidden_rows, self._extent, self._peer(peer).extent
        )

    def metadata(self) -> bytes:
        """msgpack `TransportMetadata`: NIXL agent metadata, compatibility and the registered
        memory's addresses and geometry. Give it to the peer's `connect`."""
        return self._describe().encode()

    def _describe(self) -> TransportMetadata:
        self._check_open()
        extent = self._extent
        return TransportMetadata(
            version=PROTOCOL_VERSION,
            name=self._name,
            agent_metadata=self._agent.get_agent_metadata(),
            compatibility=self._compatibility,
            memory=self._memory,
            device_id=extent.device_id,
            key_address=extent.key_address,
            value_address=extent.value_address,
            hidden_address=extent.hidden_address,
            region=self._region,
            allocated_blocks=self._allocated,
            hidden_rows=extent.hidden_rows,
            hidden_row_stride_bytes=extent.hidden_row_bytes,
        )

    def peer_region(self, peer: str) -> KVRegion:
        return self._peer(peer).meta.region

    def is_connected(self, peer: str) -> bool:
        return peer in self._peers

    # -- handshake -----------------------------------------------------------------------------

    def connect(self, peer_metadata: bytes) -> str:
        """Check compatibility (PDCompatibilityError naming every mismatching field), load the
        peer's agent metadata, connect now and prepare the peer's descriptor list (README.md,
        "Handshake"). Returns the peer's name; a known name's old connection is replaced."""
        local = self._describe()
        peer = TransportMetadata.decode(peer_metadata)
        check_compatibility(local, peer)
        if peer.name == self._name:
            raise PDTransportError(f"peer has this agent's own name {peer.name!r}")
        if peer.name in self._peers:
            self.disconnect(peer.name)
        agent = self._agent
        loaded = False
        try:
            name = _as_str(agent.add_remote_agent(peer.agent_metadata))
            loaded = True
            if name != peer.name:
                raise PDTransportError(
                    f"NIXL metadata names agent {name!r}, the handshake {peer.name!r}"
                )
            agent.make_connection(name)
            extent = MemoryExtent.of_peer(peer)
            remote_dlist = agent.prep_xfer_dlist(
                name, descriptors.prepared_table(extent), peer.memory
            )
        except Exception as error:
            if loaded:
                try:
                    agent.remove_remote_agent(peer.name)
                except Exception:  # best effort
                    log.exception("removing half-connected peer %s", peer.name)
            if isinstance(error, PDTransportError):
                raise
            raise PDTransportError(f"cannot connect to {peer.name!r}: {error!r}") from error
        self._peers[peer.name] = _Peer(peer, extent, remote_dlist)
        return peer.name

    def disconnect(self, peer: str) -> None:
        """Abort writes to `peer` that NIXL can still abort (reported failed by the next poll),
        release its prepared list and remove the agent. Unknown peers are ignored."""
        state = self._peers.pop(peer, None)
        if state is None or self._closed:
            return
        for handle, write in list(self._inflight.items()):
            if write.peer == peer and self._release(write.xfer):
                del self._inflight[handle]
                self._failed.append((handle, f"peer {peer!r} disconnected"))
        self._release(state.remote_dlist)
        try:
            self._agent.remove_remote_agent(peer)
        except Exception:
            log.exception("removing NIXL peer %s", peer)

    def close(self) -> None:
        """Disconnect every peer, release handles, deregister the memory and drop the agent.
        Idempotent. Writes NIXL cannot abort are abandoned (logged)."""
        if self._closed:
            return
        for peer in list(self._peers):
            self.disconnect(peer)
        for write in self._inflight.values():
            if not self._release(write.xfer):
                log.error("closing %s with a write to %s still active", self._name, write.peer)
        self._inflight.clear()
        if self._local_dlist is not None:
            self._release(self._local_dlist)
            self._local_dlist = None
        if self._registration is not None:
            try:
                self._agent.deregister_memory(self._registration)
            except Exception:
                log.exception("deregistering %s's memory", self._name)
            self._registration = None
        self._closed = True
        self._agent = None
        self._owner = None

    # -- transfers -----------------------------------------------------------------------------

    def write(
        self,
        peer: str,
        partition: TransferPartition,
        notification: ControlMessage,
        *,
        hidden_rows: tuple[int, int] | None = None,
    ) -> int:
        """Post `partition` as one WRITE to `peer`; the peer receives `notification` after its
        bytes landed. See transport_api.Transport.write."""
        self._check_open()
        handle = next(self._handles)
        state = self._peers.get(peer)
        if state is None:
            self._failed.append((handle, f"peer {peer!r} is not connected"))
            return handle
        descriptors.validate(partition, hidden_rows, self._extent, state.extent)
        notif = encode_message(notification)
        agent = self._agent
        xfer = None
        try:
            indices = descriptors.prepared_indices(
                partition, hidden_rows, self._extent, state.extent
            )
            if indices is not None:
                xfer = agent.make_prepped_xfer(
                    "WRITE", self._local_dlist, indices[0], state.remote_dlist, indices[1], notif
                )
                path = "prepped"
            else:
                path = "explicit"
                local, remote = descriptors.explicit_descriptors(
                    partition, hidden_rows, self._extent, state.extent
                )
                xfer = agent.initialize_xfer(
                    "WRITE",
                    agent.get_xfer_descs(local, self._memory),
                    agent.get_xfer_descs(remote, state.meta.memory),
                    peer,
                    notif,
                )
            status = agent.transfer(xfer)
            self._posted[path] += 1
        except Exception as error:
            if xfer is not None:
                self._release(xfer)
            self._failed.append((handle, f"posting a write to {peer!r} failed: {error!r}"))
            return handle
        if status == "DONE":
            self._release(xfer)
            self._completed.append(handle)
        elif status == "ERR":
            self._release(xfer)
            self._failed.append((handle, f"NIXL reported ERR posting a write to {peer!r}"))
        else:
            self._inflight[handle] = _Write(peer, xfer)
        return handle

    def poll(self) -> TransportPoll:
        """Writes that finished (DONE) or failed (ERR, an exception) since the last poll."""
        completed, failed = self._completed, self._failed
        self._completed, self._failed = [], []
        if self._closed:
            return TransportPoll(completed, failed)
        for handle, write in list(self._inflight.items()):
            try:
                state = self._agent.check_xfer_state(write.xfer)
            except Exception as error:
                state, reason = "ERR", f"checking a write to {write.peer!r} failed: {error!r}"
            else:
                reason = f"NIXL reported ERR for a write to {write.peer!r}"
            if state == "PROC":
                continue
            del self._inflight[handle]
            self._release(write.xfer)
            if state == "DONE":
                completed.append(handle)
            else:
                failed.append((handle, reason))
        return TransportPoll(completed, failed)

    def send(self, peer: str, message: ControlMessage) -> None:
        """Send one control message as a NIXL notification (raises PDTransportError)."""
        self._check_open()
        if peer not in self._peers:
            raise PDTransportError(f"cannot send to {peer!r}: not connected")
        try:
            self._agent.send_notif(peer, encode_message(message))
        except Exception as error:
            raise PDTransportError(f"sending {message!r} to {peer!r} failed: {error!r}") from error

    def notifications(self) -> list[tuple[str, bytes]]:
        """(peer, raw message) pairs received since the last call."""
        self._check_open()
        try:
            received = self._agent.get_new_notifs()
        except Exception as error:
            raise PDTransportError(f"reading NIXL notifications failed: {error!r}") from error
        return [(_as_str(peer), msg) for peer, msgs in received.items() for msg in msgs]

    # -- internals -----------------------------------------------------------------------------

    def _peer(self, peer: str) -> _Peer:
        self._check_open()
        try:
            return self._peers[peer]
        except KeyError:
            raise PDTransportError(f"peer {peer!r} is not connected") from None

    def _check_open(self) -> None:
        if self._closed:
            raise PDTransportError(f"transport {self._name!r} is closed")

    @staticmethod
    def _release(handle) -> bool:
        """Release a NIXL handle; False when NIXL refused (an active transfer it cannot
        abort)."""
        try:
            handle.release()
        except Exception:
            log.exception("releasing NIXL handle %r", handle)
            return False
        return True
