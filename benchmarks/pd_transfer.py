"""KV transfer throughput of PD disaggregation between two processes, on the engine's path.

One prefill side (P, this process) pushes a prompt's KV into a decode side (D, a spawned process)
through rlt-pd's `KVTransport` (one NIXL agent each, UCX backend) and the engine's connectors:
P's `KVSender.start` + `send_chunk` per prefill chunk (then `poll`, once per step as the engine
does), `final_hidden_row` on the last; D's `KVReceiver.expect` + `poll` until COMPLETED (every
byte is on D). Per prompt size: the bytes moved (K and V of every plane and layer, plus the last
hidden state), the wall time from P's first `send_chunk` to D's COMPLETED (CLOCK_MONOTONIC,
shared by both processes), GB/s of the median and the best of N, P's own times (chunks handed
over; writes completed = DONE) and how the sender split the work (partitions, NIXL writes by
prepped-index / explicit path, descriptors). The first transfer of each size lands in cleared
blocks and is verified (checksums of P's source and D's destination positions per plane, layer
and tensor, and of the hidden row: BLAKE2b on the CPU, exact integer sums on the GPU). No
compute overlaps the transfer: the upper bound of what the engine's handoff can do on a link.

Default shape: Ouro-1.4B (24 layers, 16 KV heads of 128, hidden 2048, 4 loops) in bf16, block
size 16, `last_exited`: 4 planes, 768 KiB per prompt token (a 16384-token prompt moves 12 GiB).
`--shape ouro-2.6b` doubles the layers, `bundled` is the engine's tiny model; `--kv-layout
shared` keeps one plane. Block tables: `contiguous` (ascending ids: few, long descriptors) and
`random` (seeded permutations: one descriptor per block and layer, a busy engine's fragmented
pool, where the descriptor limit splits partitions); both by default. Each side's pool holds the
largest size's blocks plus the scratch block, allocated once.

CPU (DRAM over UCX shared memory / CMA on one host; < 2 minutes on 2 cores):

    uv run python benchmarks/pd_transfer.py --quick --out benchmarks/results/pd_transfer_cpu.json

`--quick` = sizes 256,1024,2048, 3 repetitions, 1 warm-up. Without it: 256,1024,4096,16384 and
5 repetitions, which needs 2 x 12 GiB of memory (16384 tokens) for the Ouro shape.

GPU, VRAM to VRAM: `bash tools/h200_run.sh pd` or `pd-transfer` (carry the slim NIXL wheels of
tools/repack_nixl_wheel.py), P on cuda:0 and D on cuda:1 of `nvidia-h200-x2` (`--device cuda:0`
puts both on one GPU). UCX picks its transports itself (cuda_ipc between GPUs of one host,
cma/sysv/posix for DRAM); set `UCX_TLS` to force one; `--ucx-param KEY=VALUE` passes UCX backend
parameters to NIXL (e.g. num_workers). NVLink multicast stays off in both processes.

`--progress-delay-us 0,100` rebuilds both sides for each NIXL progress-thread delay
(`rlt_pd.nixl_agent`; 0 = NIXL's own, which polls without pause) and measures each side's idle
CPU and every size at each, side by side in one run.

Output: the JSON record (`--out`: configuration, every repetition's times, per-size summary) and
a markdown table on stdout. Caveats: on a small CPU machine P's main thread, P's NIXL
progress thread and D's polling loop share the cores, so CPU numbers measure memcpy under
contention, not a network; `--poll-interval-us` sets both sides' polling sleep.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass

from harness import NO_MULTICAST, markdown_table, parser, record, version, write_json

SHAPES = {
    # layers, KV heads, head_dim, hidden size, loops (total_ut_steps)
    "ouro-1.4b": dict(layers=24, kv_heads=16, head_dim=128, hidden=2048, loops=4),
    "ouro-2.6b": dict(layers=48, kv_heads=16, head_dim=128, hidden=2048, loops=4),
    "bundled": dict(layers=4, kv_heads=4, head_dim=64, hidden=256, loops=4),
}
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
HIDDEN_ROWS = 4
P_HIDDEN_ROW, D_HIDDEN_ROW = 0, 1


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    loops: int
    kv_layout: str
    dtype: str
    block_size: int
    max_tokens: int

    @property
    def planes(self) -> int:
        return self.loops if self.kv_layout == "last_exited" else 1

    @property
    def element(self) -> int:
        return DTYPES[self.dtype]

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def num_blocks(self) -> int:  # without the scratch block
        return self.planes * self.pages(self.max_tokens)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.layers, self.num_blocks + 1, self.block_size, self.kv_heads, self.head_dim)

    @property
    def pool_bytes(self) -> int:  # K + V of one side
        return 2 * math.prod(self.shape) * self.element

    def kv_bytes(self, tokens: int) -> int:
        per_token = self.planes * self.layers * 2 * self.kv_heads * self.head_dim * self.element
        return tokens * per_token

    @property
    def hidden_bytes(self) -> int:
        return self.hidden * self.element

    def compatibility(self):
        from rlt_contracts.pd import PDCompatibility

        return PDCompatibility(
            model_identity=f"pd-transfer-bench:{self.layers}x{self.kv_heads}x{self.head_dim}",
            num_layers=self.layers,
            num_loops=self.loops,
            kv_layout=self.kv_layout,
            dtype=self.dtype,
            block_size=self.block_size,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            block_bytes=2 * self.block_size * self.kv_heads * self.head_dim * self.element,
            hidden_bytes=self.hidden_bytes,
        )


def make_tables(geometry: Geometry, tokens: int, kind: str, seed: int) -> tuple:
    """One table per plane covering `tokens`; distinct blocks of the pool."""
    pages, planes = geometry.pages(tokens), geometry.planes
    if kind == "contiguous":
        blocks = list(range(planes * pages))
    else:
        blocks = random.Random(seed).sample(range(geometry.num_blocks), planes * pages)
    return tuple(tuple(blocks[p * pages : (p + 1) * pages]) for p in range(planes))


# -- both sides ----------------------------------------------------------------------------------


class Side:
    """One process's tensors and transport (P's in this process, D's in the child)."""

    def __init__(
        self, name: str, device: str, geometry: Geometry, fill_seed, ucx_params, delay_us: int
    ) -> None:
        import torch
        from rlt_pd.transport import KVTransport
        from rlt_runner.pd_regions import pd_memory

        self.torch = torch
        self.geometry = geometry
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dtype = getattr(torch, geometry.dtype)
        started = time.monotonic()
        self.key = torch.empty(geometry.shape, dtype=dtype, device=self.device)
        self.value = torch.empty(geometry.shape, dtype=dtype, device=self.device)
        self.hidden = torch.empty(HIDDEN_ROWS, geometry.hidden, dtype=dtype, device=self.device)
        if fill_seed is None:
            for tensor in (self.key, self.value, self.hidden):
                tensor.zero_()
        else:
            generator = torch.Generator(device=self.device).manual_seed(fill_seed)
            for tensor in (self.key, self.value, self.hidden):
                tensor.view(torch.int16).random_(generator=generator)
        self.synchronize()
        self.fill_s = time.monotonic() - started
        memory = pd_memory(
            self.key, self.value, self.hidden, scratch_blocks=1, num_planes=geometry.planes
        )
        self.transport = KVTransport(
            name,
            memory,
            geometry.compatibility(),
            owner=self,
            backend_params=ucx_params or None,
            progress_delay_us=delay_us,
        )

    @staticmethod
    def idle_cpu(seconds: float) -> float:
        """This process's CPU seconds per wall second while it waits (NIXL's progress thread
        is what runs)."""
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(seconds)
        return (time.process_time() - cpu) / (time.monotonic() - wall)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def digest(self, tables, tokens: int, hidden_row: int) -> list:
        """Checksums of positions [0, tokens) of every plane and layer (K then V) and of one
        hidden row; equal on both sides iff (barring collisions) every byte landed where it
        belongs. CPU: BLAKE2b of the gathered bytes. CUDA: exact integer sums computed on the
        device (no copy of the KV to the host): per slice the sum of its int16 words and their
        position-weighted sum (weights 1..65521: int64 cannot overflow)."""
        torch = self.torch
        g = self.geometry
        pages = g.pages(tokens)
        count = tokens * g.kv_heads * g.head_dim * g.element // 2  # int16 words of a slice
        on_cpu = self.device.type == "cpu"
        blake = hashlib.blake2b(digest_size=16)
        weights = None if on_cpu else torch.arange(count, device=self.device) % 65521 + 1
        sums = []

        def add(words16) -> None:
            if on_cpu:
                blake.update(words16.numpy())
                return
            values = words16.to(torch.int64)
            sums.append(int(values.sum()))
            sums.append(int((values * weights[: values.numel()]).sum()))

        for tensor in (self.key, self.value):
            for table in tables:
                index = torch.tensor(table[:pages], device=self.device)
                for layer in range(g.layers):
                    picked = tensor[layer].index_select(0, index).view(torch.int16)
                    add(picked.reshape(-1)[:count])
        add(self.hidden[hidden_row].view(torch.int16))
        return [blake.hexdigest()] if on_cpu else sums

    def clear(self, tables, tokens: int, hidden_row: int) -> None:
        index = self.torch.tensor(
            [b for table in tables for b in table[: self.geometry.pages(tokens)]],
            device=self.device,
        )
        self.key.index_fill_(1, index, 0)
        self.value.index_fill_(1, index, 0)
        self.hidden[hidden_row].zero_()
        self.synchronize()


# -- D: the child process ------------------------------------------------------------------------


class DecodeSide:
    def __init__(self) -> None:
        self.side = None
        self.receiver = None
        self.poll_s = 0.0

    def init(self, device, geometry, ucx_params, poll_s, wait_timeout_s, delay_us):
        from rlt_pd import KVReceiver, ReceiverConfig

        self.side = Side("D", device, Geometry(**geometry), None, ucx_params, delay_us)
        self.receiver = KVReceiver(
            self.side.transport, ReceiverConfig(wait_timeout_s, wait_timeout_s + 60)
        )
        self.poll_s = poll_s
        return self.side.transport.metadata(), self.side.fill_s

    def connect(self, metadata):
        return self.side.transport.connect(metadata)

    def expect(self, target):
        import msgspec
        from rlt_contracts.pd import HandoffTarget

        self.receiver.expect(msgspec.msgpack.decode(target, type=HandoffTarget), "P")

    def idle_cpu(self, seconds):
        return self.side.idle_cpu(seconds)

    def clear(self, tables, tokens):
        self.side.clear(tables, tokens, D_HIDDEN_ROW)

    def digest(self, tables, tokens):
        return self.side.digest(tables, tokens, D_HIDDEN_ROW)

    def receive(self, conn, transfer_id, timeout_s):
        """Poll until the transfer's outcome; tells P it is polling first."""
        conn.send(("ready", time.monotonic()))
        deadline = time.monotonic() + timeout_s
        while True:
            for event in self.receiver.poll():
                if event.transfer_id == transfer_id:
                    return dict(
                        outcome=str(event.outcome), message=event.message, t=time.monotonic()
                    )
            if time.monotonic() > deadline:
                self.receiver.cancel(transfer_id)
                return dict(outcome="timeout", message=f"no outcome in {timeout_s} s", t=None)
            if self.poll_s:
                time.sleep(self.poll_s)

    def close(self):
        self.side.transport.close()


def serve_decode(conn) -> None:
    side = DecodeSide()
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            return
        if command == "exit":
            conn.send(("ok", None))
            return
        try:
            if command == "receive":
                value = side.receive(conn, **kwargs)
            else:
                value = getattr(side, command)(**kwargs)
            conn.send(("ok", value))
        except Exception as error:
            conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


class Peer:
    """P's handle on the D process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve_decode, args=(child,), daemon=True)
        self.process.start()

    def submit(self, command: str, **kwargs) -> None:
        self.conn.send((command, kwargs))

    def reply(self, timeout: float = 600.0):
        if not self.conn.poll(timeout):
            raise RuntimeError("the decode process did not answer")
        reply = self.conn.recv()
        if reply[0] == "error":
            raise RuntimeError(f"decode process: {reply[1]}")
        return reply[1]

    def call(self, command: str, **kwargs):
        self.submit(command, **kwargs)
        return self.reply()

    def stop(self) -> None:
        try:
            if self.process.is_alive():
                self.call("close")
                self.call("exit")
        finally:
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()


# -- P: the benchmark ----------------------------------------------------------------------------


def plan_stats(geometry, sender_config, region, tables, dst_tables, tokens, chunk) -> dict:
    """Partitions and descriptors the sender will plan (computed off the clock)."""
    from rlt_contracts import ExecutionIdentity
    from rlt_pd import plan_handoff

    partitions = descriptors = 0
    sequence, position = 0, 0
    for start in range(0, tokens, chunk):
        end = min(tokens, start + chunk)
        plan = plan_handoff(
            ExecutionIdentity("stats", 0),
            tables,
            dst_tables,
            end,
            region,
            hidden_state_bytes=geometry.hidden_bytes,
            first_token=position,
            transfer_chunk_bytes=sender_config.transfer_chunk_bytes,
            max_descriptors=sender_config.max_descriptors,
            first_sequence=sequence,
            final=end == tokens,
        )
        partitions += len(plan.partitions)
        descriptors += sum(len(p.descriptors) for p in plan.partitions)
        sequence, position = plan.commit_count, end
    return dict(partitions=partitions, descriptors=descriptors)


def run_trial(side, peer, sender, geometry, tokens, tables, transfer_id, chunk, args) -> dict:
    import msgspec
    from rlt_contracts.pd import HandoffTarget
    from rlt_pd import SendOutcome

    src_tables, dst_tables = tables
    target = HandoffTarget(transfer_id, "D", dst_tables, 0, D_HIDDEN_ROW, tokens)
    peer.call("expect", target=msgspec.msgpack.encode(target))
    peer.submit("receive", transfer_id=transfer_id, timeout_s=args.timeout)
    peer.reply()  # D is polling
    posted_before = side.transport.posted
    poll_s = args.poll_interval_us / 1e6
    if not sender.start(target):
        raise RuntimeError(f"sender refused {transfer_id}")
    events = []
    t0 = time.monotonic()
    for start in range(0, tokens, chunk):
        end = min(tokens, start + chunk)
        final = P_HIDDEN_ROW if end == tokens else None
        sender.send_chunk(transfer_id, src_tables, start, end, final)
        events += sender.poll()  # the engine polls once per step
    t_posted = time.monotonic()
    deadline = t0 + args.timeout
    while not events and time.monotonic() < deadline:
        events = sender.poll()
        if not events and poll_s:
            time.sleep(poll_s)
    t_done = time.monotonic()
    received = peer.reply(args.timeout + 30)
    posted_after = side.transport.posted
    outcome = events[0].outcome if events else "timeout"
    ok = outcome == SendOutcome.DONE and received["outcome"] == "completed"
    if not ok:
        message = events[0].message if events else ""
        raise RuntimeError(f"{transfer_id}: P {outcome} {message!r}; D {received}")
    return dict(
        wall_s=received["t"] - t0,
        posted_s=t_posted - t0,
        done_s=t_done - t0,
        writes_prepped=posted_after["prepped"] - posted_before["prepped"],
        writes_explicit=posted_after["explicit"] - posted_before["explicit"],
    )


def parse_devices(text: str) -> tuple[str, str]:
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if len(devices) == 1:
        devices *= 2
    if len(devices) != 2:
        raise SystemExit(f"--device takes one device or two (P,D), got {text!r}")
    return devices[0], devices[1]


def parse_args(argv=None):
    p = parser(__doc__, device="cpu", dtype="bfloat16")
    p.add_argument("--sizes", default="256,1024,4096,16384", help="prompt tokens")
    p.add_argument("--repeats", type=int, default=5, help="timed transfers per size")
    p.add_argument("--warmup", type=int, default=1, help="untimed transfers per size first")
    p.add_argument("--quick", action="store_true", help="sizes 256,1024,2048, 3 repeats")
    p.add_argument("--shape", choices=sorted(SHAPES), default="ouro-1.4b")
    for name in ("layers", "kv_heads", "head_dim", "hidden", "loops"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="not --shape's")
    p.add_argument("--kv-layout", choices=("last_exited", "shared"), default="last_exited")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=512, help="per send_chunk (0: all)")
    p.add_argument("--tables", default="contiguous,random", help="block-table layouts")
    p.add_argument("--max-inflight-mib", type=int, default=256)
    p.add_argument("--transfer-chunk-mib", type=int, default=64)
    p.add_argument("--max-descriptors", type=int, default=256)
    p.add_argument("--ucx-param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--poll-interval-us", type=float, default=50.0, help="both sides (0: spin)")
    p.add_argument("--progress-delay-us", default="100", help="NIXL progress-thread delays")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per transfer")
    p.add_argument("--no-verify", action="store_true", help="skip the bytewise check")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick and args.sizes == p.get_default("sizes"):
        args.sizes = "256,1024,2048"
    if args.quick and args.repeats == p.get_default("repeats"):
        args.repeats = 3
    if args.dtype not in DTYPES:
        p.error(f"--dtype: one of {sorted(DTYPES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    table_kinds = [t.strip() for t in args.tables.split(",") if t.strip()]
    if not sizes or min(sizes) < 1:
        raise SystemExit("--sizes: give positive token counts")
    if set(table_kinds) - {"contiguous", "random"}:
        raise SystemExit(f"--tables: contiguous and/or random, got {args.tables!r}")
    shape = dict(SHAPES[args.shape])
    for name in shape:
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    geometry = Geometry(
        **shape,
        kv_layout=args.kv_layout,
        dtype=args.dtype,
        block_size=args.block_size,
        max_tokens=max(sizes),
    )
    ucx_params = dict(p.split("=", 1) for p in args.ucx_param)
    p_device, d_device = parse_devices(args.device)
    delays = [int(d) for d in args.progress_delay_us.split(",") if d.strip()]
    if not delays or min(delays) < 0:
        raise SystemExit("--progress-delay-us: give delays >= 0 (microseconds)")

    for key, value in {**NO_MULTICAST, "NIXL_LOG_LEVEL": "WARN"}.items():  # D inherits them
        os.environ.setdefault(key, value)  # (NIXL logs INFO lines to stdout otherwise)
    import nixl  # noqa: F401 - fail early when NIXL is missing
    from rlt_pd import SenderConfig

    sender_config = SenderConfig(
        max_inflight_bytes=args.max_inflight_mib << 20,
        transfer_chunk_bytes=args.transfer_chunk_mib << 20,
        max_descriptors=args.max_descriptors,
    )
    print(
        f"pd_transfer: {args.shape} {geometry.layers} layers x {geometry.planes} planes x "
        f"{geometry.kv_heads} heads x {geometry.head_dim}, {geometry.dtype}, block "
        f"{geometry.block_size}: {geometry.kv_bytes(1) / 1024:.0f} KiB/token; pool "
        f"{geometry.pool_bytes / 2**30:.2f} GiB per side; P on {p_device}, D on {d_device}",
        file=sys.stderr,
    )
    load_before = os.getloadavg()
    started = time.monotonic()
    results, fill_s, idle_cpu = [], {}, {}
    for delay_us in delays:
        measured = measure(args, geometry, sizes, table_kinds, ucx_params, sender_config, delay_us)
        results += measured["results"]
        fill_s = measured["fill_s"]
        idle_cpu[str(delay_us)] = measured["idle_cpu"]
        print(
            f"  progress delay {delay_us} us: idle CPU P {measured['idle_cpu']['prefill']:.2f}, "
            f"D {measured['idle_cpu']['decode']:.2f} (CPU s per s)",
            file=sys.stderr,
        )

    config = dict(
        shape=args.shape,
        geometry=asdict(geometry),
        planes=geometry.planes,
        bytes_per_token=geometry.kv_bytes(1),
        pool_bytes_per_side=geometry.pool_bytes,
        prefill_device=p_device,
        decode_device=d_device,
        sizes=sizes,
        tables=table_kinds,
        chunk_tokens=args.chunk_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        sender=asdict(sender_config),
        ucx_params=ucx_params,
        ucx_tls=os.environ.get("UCX_TLS"),
        poll_interval_us=args.poll_interval_us,
        progress_delay_us=delays,
        idle_cpu_per_s=idle_cpu,
        fill_s=fill_s,
    )
    report = record("pd_transfer", args, nixl=version("nixl"), load_average=[load_before])
    report["load_average"].append(os.getloadavg())
    report |= {"wall_s": time.monotonic() - started, "config": config, "results": results}
    write_json(args.out, report)
    print(markdown(report))
    return 0


IDLE_CPU_S = 1.0  # idle time over which each side's CPU use is measured


def measure(args, geometry, sizes, table_kinds, ucx_params, sender_config, delay_us) -> dict:
    """Every size and table kind with both sides' agents at one progress-thread delay."""
    from rlt_pd import KVSender

    p_device, d_device = parse_devices(args.device)
    peer = Peer()
    try:
        peer.submit(
            "init",
            device=d_device,
            geometry=asdict(geometry),
            ucx_params=ucx_params,
            poll_s=args.poll_interval_us / 1e6,
            wait_timeout_s=args.timeout,
            delay_us=delay_us,
        )
        side = Side("P", p_device, geometry, args.seed + 1, ucx_params, delay_us)
        d_metadata, d_fill_s = peer.reply()
        side.transport.connect(d_metadata)
        peer.call("connect", metadata=side.transport.metadata())
        sender = KVSender(side.transport, sender_config)
        peer.submit("idle_cpu", seconds=IDLE_CPU_S)
        idle_cpu = dict(prefill=side.idle_cpu(IDLE_CPU_S), decode=peer.reply())
        results = []
        trial_number = 0
        for kind in table_kinds:
            for tokens in sizes:
                seed = args.seed * 1000003 + tokens
                tables = (
                    make_tables(geometry, tokens, kind, seed),
                    make_tables(geometry, tokens, kind, seed + 1),
                )
                chunk = args.chunk_tokens or tokens
                stats = plan_stats(
                    geometry, sender_config, side.transport.region, *tables, tokens, chunk
                )
                verified, verify_s = None, 0.0
                if not args.no_verify:
                    begin = time.monotonic()
                    peer.call("clear", tables=tables[1], tokens=tokens)
                    verify_s += time.monotonic() - begin
                trials = []
                for i in range(args.warmup + args.repeats):
                    trial_number += 1
                    tid = f"bench-{trial_number}-{kind}-{tokens}-{i}"
                    trial = run_trial(
                        side, peer, sender, geometry, tokens, tables, tid, chunk, args
                    )
                    if i == 0 and not args.no_verify:
                        begin = time.monotonic()
                        peer.submit("digest", tables=tables[1], tokens=tokens)
                        mine = side.digest(tables[0], tokens, P_HIDDEN_ROW)
                        verified = mine == peer.reply()
                        verify_s += time.monotonic() - begin
                        if not verified:
                            raise RuntimeError(f"{tid}: D's bytes differ from P's")
                    if i >= args.warmup:
                        trials.append(trial)
                total = geometry.kv_bytes(tokens) + geometry.hidden_bytes
                walls = [t["wall_s"] for t in trials]
                median = statistics.median(walls)
                row = dict(
                    progress_delay_us=delay_us,
                    tokens=tokens,
                    tables=kind,
                    bytes=total,
                    kv_bytes=geometry.kv_bytes(tokens),
                    hidden_bytes=geometry.hidden_bytes,
                    chunks=-(-tokens // chunk),
                    **stats,
                    writes_prepped=trials[0]["writes_prepped"],
                    writes_explicit=trials[0]["writes_explicit"],
                    verified=verified,
                    verify_s=verify_s,
                    median_wall_s=median,
                    min_wall_s=min(walls),
                    max_wall_s=max(walls),
                    median_posted_s=statistics.median(t["posted_s"] for t in trials),
                    median_done_s=statistics.median(t["done_s"] for t in trials),
                    gbps_median=total / median / 1e9,
                    gbps_best=total / min(walls) / 1e9,
                    trials=trials,
                )
                results.append(row)
                print(
                    f"  delay {delay_us:5} us {kind:10} {tokens:6} tokens: "
                    f"{total / 2**20:9.1f} MiB, median "
                    f"{median * 1e3:8.2f} ms, {row['gbps_median']:6.2f} GB/s "
                    f"(verification {verify_s:.1f} s, load average {os.getloadavg()[0]:.1f})",
                    file=sys.stderr,
                )
    finally:
        peer.stop()
        if "side" in locals():
            side.transport.close()
    fill_s = dict(prefill=side.fill_s, decode=d_fill_s)
    return dict(results=results, fill_s=fill_s, idle_cpu=idle_cpu)


def markdown(report: dict) -> str:
    config = report["config"]
    idle = config["idle_cpu_per_s"]
    head = (
        f"KV transfer P ({config['prefill_device']}) -> D ({config['decode_device']}), "
        f"{config['shape']} {config['geometry']['dtype']}, {config['planes']} planes, "
        f"{config['bytes_per_token'] / 1024:.0f} KiB/token, chunks of "
        f"{config['chunk_tokens'] or 'all'} tokens; median of {config['repeats']} "
        f"(+{config['warmup']} warm-up); wall = first send_chunk -> D COMPLETED\n\n"
        "idle CPU seconds per second (P, D) by progress delay: "
        + ", ".join(f"{d} us: {v['prefill']:.2f}, {v['decode']:.2f}" for d, v in idle.items())
    )
    header = ["delay us", "tokens", "tables", "MiB", "partitions", "writes (idx/expl)"]
    header += ["descriptors", "wall median ms", "min ms", "max ms", "P posted ms", "P DONE ms"]
    header += ["GB/s median", "GB/s best", "verified"]
    rows = []
    for r in report["results"]:
        ms = [r[k] * 1e3 for k in ("median_wall_s", "min_wall_s", "max_wall_s")]
        ms += [r[k] * 1e3 for k in ("median_posted_s", "median_done_s")]
        cells = [r["progress_delay_us"], r["tokens"], r["tables"], f"{r['bytes'] / 2**20:.1f}"]
        cells += [r["partitions"], f"{r['writes_prepped']}/{r['writes_explicit']}"]
        cells += [r["descriptors"], *(f"{v:.2f}" for v in ms)]
        cells += [f"{r['gbps_median']:.2f}", f"{r['gbps_best']:.2f}"]
        rows.append(cells + [{True: "yes", False: "NO", None: "-"}[r["verified"]]])
    return head + "\n\n" + markdown_table(header, rows)


if __name__ == "__main__":
    sys.exit(main())
