"""Host <-> GPU copy rates: pageable against pinned host memory, as optimizer offload moves data.

With ``training.memory.offload_optimizer`` every step sends the fp32 gradients down to the host
(4 bytes per parameter) and the updated bf16 weights back up (2 bytes per parameter); DeepSpeed
runs these copies from pageable memory (``pin_memory: false``, see
anchorctx/training/deepspeed_env.py). This measures what a copy of each kind costs from pageable
and from pinned memory, and what making a pinned copy of a buffer costs (``pin_memory``: a
page-locked allocation and one copy into it), so the seconds a 7B step could save are
arithmetic rather than a guess:

    python bench/host_copies.py --gib 1 4 --out host-copies.json

Floor: the host link's peak per direction (PCIe 5.0 x16: 64 GB/s; ``--link-gbs``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

GB = 1e9
# Bytes a step moves per parameter with the optimizer offloaded (ZeRO with bf16 weights).
DOWN_BYTES_PER_PARAM = 4  # fp32 gradients, device to host
UP_BYTES_PER_PARAM = 2  # bf16 weights, host to device


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` between device synchronisations (one untimed first call)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rates(gib: float, repeats: int) -> dict:
    n = int(gib * 2**30) // 4  # fp32 elements
    gpu = torch.empty(n, dtype=torch.float32, device="cuda")
    pageable = torch.empty(n, dtype=torch.float32)
    pageable.fill_(1.0)  # touch every page: first-touch faults are not a copy's cost
    t0 = time.perf_counter()
    pinned = torch.empty(n, dtype=torch.float32).pin_memory()
    pin_s = time.perf_counter() - t0
    size = n * 4
    row = {"gib": gib, "bytes": size, "pin_s": round(pin_s, 3)}
    for name, host in (("pageable", pageable), ("pinned", pinned)):
        down = timed(lambda host=host, gpu=gpu: host.copy_(gpu, non_blocking=True), repeats)
        up = timed(lambda host=host, gpu=gpu: gpu.copy_(host, non_blocking=True), repeats)
        row[f"{name}_down_gbs"] = round(size / down / GB, 2)
        row[f"{name}_up_gbs"] = round(size / up / GB, 2)
    del gpu, pageable, pinned
    torch.cuda.empty_cache()
    return row


def step_copies(row: dict, params_b: float) -> dict:
    """Seconds per step of the offload's copies for ``params_b`` billion parameters, at the
    measured rates (the copies as if serial, none overlapped with compute)."""
    down, up = params_b * 1e9 * DOWN_BYTES_PER_PARAM, params_b * 1e9 * UP_BYTES_PER_PARAM
    out = {}
    for name in ("pageable", "pinned"):
        out[f"{name}_s"] = round(
            down / (row[f"{name}_down_gbs"] * GB) + up / (row[f"{name}_up_gbs"] * GB), 2
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0], help="Buffer sizes.")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--params-b", type=float, default=6.74, help="Model size for the per-step sum.")
    p.add_argument("--link-gbs", type=float, default=64.0, help="Host link peak per direction.")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    rows = [rates(g, args.repeats) for g in args.gib]
    big = rows[-1]
    report = {
        "device": torch.cuda.get_device_name(),
        "link_gbs": args.link_gbs,
        "rows": rows,
        "per_step": {"params_b": args.params_b, **step_copies(big, args.params_b)},
    }
    floor = args.params_b * 1e9 * (DOWN_BYTES_PER_PARAM + UP_BYTES_PER_PARAM) / (args.link_gbs * GB)
    report["per_step"]["floor_s"] = round(floor, 2)
    print("| GiB | down pageable | down pinned | up pageable | up pinned | pin s | link |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['gib']:g} | {r['pageable_down_gbs']} | {r['pinned_down_gbs']} | "
            f"{r['pageable_up_gbs']} | {r['pinned_up_gbs']} | {r['pin_s']} | {args.link_gbs:g} |"
        )
    s = report["per_step"]
    print(
        f"\n{args.params_b}B parameters, one step's offload copies: pageable {s['pageable_s']} s, "
        f"pinned {s['pinned_s']} s, link floor {s['floor_s']} s"
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
