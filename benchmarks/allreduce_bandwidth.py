"""gloo all_reduce bandwidth vs message size, for 2 and 4 ranks on this machine.

Bandwidths as defined by nccl-tests (PERFORMANCE.md there):
  algbw = S / t                      S = message size in bytes, t = time of one all_reduce
  busbw = algbw * 2 (n - 1) / n      what each rank's links carry in a ring all-reduce,
                                     comparable across rank counts and with the memory
                                     bandwidth (here: one core's memcpy)
All ranks live on one machine, so "the network" is loopback TCP through the kernel.

    python benchmarks/allreduce_bandwidth.py [--quick]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import course  # noqa: E402

KiB, MiB = 1024, 1024 * 1024


def time_all_reduce(rank, world_size, sizes, budget_s):
    """Median seconds per all_reduce of a float32 tensor of each size (bytes)."""
    results = {}
    for size in sizes:
        t = torch.ones(size // 4)
        dist.all_reduce(t)  # warm-up: connections, allocation
        times = []
        spent = 0.0
        while len(times) < 3 or (spent < budget_s and len(times) < 50):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's view
            times.append(elapsed.item())
            spent += elapsed.item()
        results[size] = sorted(times)[len(times) // 2]
    return results


def memcpy_bandwidth(size=64 * MiB, repeats=10):
    torch.set_num_threads(1)
    src, dst = torch.ones(size // 4), torch.empty(size // 4)
    dst.copy_(src)
    seconds = common.median(common.timed(lambda: dst.copy_(src), repeats))
    return size / seconds  # bytes copied per second (read + write of `size` each)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small sizes, 2 ranks, 3 runs each (smoke test: times nothing well)")
    parser.add_argument("--out", help="folder for the plot (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.quick:
        sizes, rank_counts, budget = [4 * KiB, 64 * KiB], [2], 0.0
    else:
        sizes, rank_counts, budget = [4 * KiB * 4**i for i in range(8)], [2, 4], 1.0  # 4 KiB ... 64 MiB

    common.header("gloo all_reduce (sum, float32) on one machine")
    memcpy = memcpy_bandwidth(min(64 * MiB, max(sizes) * 4))
    print(f"# memcpy bandwidth, one core: {memcpy / 1e9:.2f} GB/s\n")
    rows, curves = [], {}
    for n in rank_counts:
        medians = course.launch(time_all_reduce, n, sizes, budget, show=None, timeout=600)[0]
        for size, seconds in medians.items():
            algbw = size / seconds
            busbw = algbw * 2 * (n - 1) / n
            curves.setdefault(n, []).append((size, busbw))
            label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
            rows.append([n, label, f"{seconds * 1e6:.0f}", f"{algbw / 1e9:.3f}", f"{busbw / 1e9:.3f}", f"{busbw / memcpy:.1%}"])
    common.table(["ranks", "size", "time us", "algbw GB/s", "busbw GB/s", "busbw/memcpy"], rows)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n, points in curves.items():
        ax.plot([s for s, _ in points], [b / 1e9 for _, b in points], marker="o", label=f"{n} ranks, busbw")
    ax.axhline(memcpy / 1e9, color="grey", linestyle="--", label="memcpy, one core")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title("gloo all_reduce on one machine (loopback)")
    ax.legend()
    common.save_plot(fig, "allreduce_bandwidth.png", args.out)


if __name__ == "__main__":
    main()
