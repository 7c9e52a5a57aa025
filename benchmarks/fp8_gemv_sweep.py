"""fp8 against bf16 projections at few rows, per Ouro-1.4B shape, timed as a decode loop runs them.

For every projection shape of the Ouro-1.4B stack (qkv, o, gate_up, down) and row count, the
same loop-like timing as `small_batch_linear` (a CUDA graph of one call per cold weight copy,
copies over twice the L2 cache, median of replays): cuBLAS bf16, the fastest bf16 Triton tile,
every fp8 candidate of `Fp8Linear.candidates` (weight-only tiles, at one row the persistent
GEMVs of `fp8_gemv`, W8A8, the dequantize reference), each checked against the dequantized
product first; the fp8 selector's choice; and the bandwidth each reaches (weight bytes / time).
Times are per call: a graph's time over its number of copies (fp8 weights are half the bytes,
so they get twice the copies). Per shape the JSON gives every candidate's time and GB/s, the
best per kind and the best overall. Run on a GPU:

    python3 benchmarks/fp8_gemv_sweep.py --rows 1,4,16 --out fp8_gemv_sweep.json
    python3 benchmarks/fp8_gemv_sweep.py --rows 1 --out fp8_gemv_rows1.json
"""

from __future__ import annotations

from harness import ints, parser, record, write_json

# (name, N, K) of Ouro-1.4B: hidden 2048, 16 heads of 128, intermediate 5632
SHAPES = (("qkv", 6144, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632))


def sweep(rows: int, name: str, n: int, k: int) -> dict:
    import torch
    import torch.nn.functional as F
    from rlt_models import fp8_linear as fl
    from rlt_models import small_batch_linear as sbl
    from rlt_models.fp8 import Fp8Projection, quantize_per_channel

    bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    data, scale = quantize_per_channel(bf16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bf16_copies = sbl._cold_copies(bf16)
    fp8_copies = fl._cold_copies(data, scale)
    result = {"rows": rows, "shape": name, "n": n, "k": k}
    result["bf16_copies"], result["fp8_copies"] = len(bf16_copies), len(fp8_copies)

    def per_call_bf16(fn) -> float:
        return sbl._time_over(bf16_copies, fn) / len(bf16_copies)

    def per_call_fp8(fn) -> float:
        return sbl._time_over(fp8_copies, fn) / len(fp8_copies)

    result["bf16_cublas_ms"] = per_call_bf16(lambda w: F.linear(x, w))
    bf16_tiles = {}
    for tile in sbl.CONFIGS:
        if tile.single_row and rows != 1:
            continue
        bf16_tiles[str(tile)] = per_call_bf16(lambda w, t=tile: sbl.launch(x, w, t))
    result["bf16_best_tile_ms"] = min(bf16_tiles.values())
    reference = F.linear(x.float(), data.float() * scale[:, None])
    largest = reference.abs().max().item() + 1e-6
    fp8_times, kinds, failed = {}, {}, {}
    for choice in fl.Fp8Linear.candidates(rows, data, torch.bfloat16):
        label = choice.kind if choice.tile is None else f"{choice.kind} {choice.tile}"
        try:  # a config the device's Triton cannot compile is reported, not fatal
            error = (fl.run(choice, x, data, scale).float() - reference).abs().max().item()
            if error > fl.TOLERANCE[choice.kind] * largest:
                failed[label] = f"max error {error:.3g} of {largest:.3g}"
                continue
            fp8_times[label] = per_call_fp8(fl._timed(choice, x))
        except Exception as exc:  # noqa: BLE001
            failed[label] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        best = kinds.get(choice.kind)
        if best is None or fp8_times[label] < fp8_times[best]:
            kinds[choice.kind] = label
    result["fp8_ms"] = fp8_times
    result["fp8_gbps_by_choice"] = {label: n * k / ms / 1e6 for label, ms in fp8_times.items()}
    result["fp8_best_by_kind"] = {
        kind: {"choice": label, "ms": fp8_times[label], "gbps": n * k / fp8_times[label] / 1e6}
        for kind, label in kinds.items()
    }
    result["fp8_failed"] = failed
    result["fp8_best"] = min(fp8_times, key=fp8_times.get)
    result["fp8_best_ms"] = fp8_times[result["fp8_best"]]
    selector = fl.Fp8Linear()
    selector(x, Fp8Projection(data, scale))
    (chosen,) = selector.choices.values()
    result["selector_choice"] = str(chosen)
    bf16_best = min(result["bf16_cublas_ms"], result["bf16_best_tile_ms"])
    result["bf16_gbps"] = n * k * 2 / bf16_best / 1e6
    result["fp8_gbps"] = n * k / result["fp8_best_ms"] / 1e6
    result["fp8_speedup"] = bf16_best / result["fp8_best_ms"]
    return result


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--rows", default="1,4,16")
    args = p.parse_args(argv)
    results = []
    for rows in ints(args.rows):
        for name, n, k in SHAPES:
            r = sweep(rows, name, n, k)
            results.append(r)
            bf16_ms = min(r["bf16_cublas_ms"], r["bf16_best_tile_ms"])
            print(
                f"rows {rows:3d} {name:8s} bf16 {bf16_ms:.4f} ms ({r['bf16_gbps']:.0f} GB/s)  "
                f"fp8 {r['fp8_best_ms']:.4f} ms ({r['fp8_gbps']:.0f} GB/s) "
                f"{r['fp8_speedup']:.2f}x  best {r['fp8_best']}  selector {r['selector_choice']}",
                flush=True,
            )
            for kind, best in r["fp8_best_by_kind"].items():
                print(
                    f"    {kind:24s} {best['ms']:.4f} ms {best['gbps']:5.0f} GB/s {best['choice']}"
                )
            for label, why in r["fp8_failed"].items():
                print(f"    failed {label}: {why}")
            # after every shape: a run cut short keeps what it measured
            write_json(
                args.out, record("fp8_gemv_sweep", vars(args) | {"device": "cuda"}, results=results)
            )


if __name__ == "__main__":
    main()
