"""Collective bandwidth between the GPUs of one host, as the layout plan uses it.

NCCL's all-gather, reduce-scatter and all-to-all over every process of ``torchrun``, at message
sizes from a layer's weights to a model's, in bus bandwidth (nccl-tests' convention: a
collective over N ranks of S bytes moves S·(N−1)/N bytes through each GPU's link, so the time is
S·(N−1)/N / busbw), plus the time of a small call (latency):

    torchrun --nproc-per-node 2 bench/links.py --out links-2gpu.json

The plan's link table (anchorctx.training.layout_plan.LINKS) is these numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _k, _v in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(size_bytes: int, world: int, repeats: int) -> dict:
    """busbw (GB/s) of each collective on ``size_bytes`` (the whole gathered / reduced tensor)."""
    n = size_bytes // 2 // world * world  # bf16 elements, divisible by the world
    full = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    part = torch.empty(n // world, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(full)
    calls = {
        "all_gather": lambda: dist.all_gather_into_tensor(full, part),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
        "all_to_all": lambda: dist.all_to_all_single(out, full),
    }
    row = {"bytes": n * 2}
    for name, fn in calls.items():
        s = timed(fn, repeats)
        row[name + "_s"] = s
        row[name + "_busbw_gbps"] = round(n * 2 * (world - 1) / world / s / 1e9, 1)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64, 256, 1024])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rows = [measure(int(mb * 2**20), world, args.repeats) for mb in args.sizes_mb]
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        report = {"device": torch.cuda.get_device_name(), "world": world, "rows": rows}
        print(json.dumps(report, indent=1))
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
