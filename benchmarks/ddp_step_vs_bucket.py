"""DDP step time vs bucket_cap_mb, and vs no DDP, for a stack of linear layers.

The model is 12 x Linear(256, 256) (about 0.8 M parameters, 3.2 MB of gradients),
global batch 64 split over the ranks. Smaller buckets start all-reducing earlier
(more overlap with backward) but pay gloo's per-message cost more often.

    python benchmarks/ddp_step_vs_bucket.py [--ranks 2] [--steps 30] [--quick]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import course  # noqa: E402

GLOBAL_BATCH = 64


def make_model(layers=12, width=256):
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def step_times(model, batch, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 256), torch.randn(batch, 256)
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times[3:]  # the first steps build buckets and warm caches


def ddp_job(rank, world_size, bucket_cap_mb, steps):
    model = DDP(make_model(), bucket_cap_mb=bucket_cap_mb)
    times = torch.tensor(step_times(model, GLOBAL_BATCH // world_size, steps), dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    logged = model._get_ddp_logging_data()  # after the first step DDP rebuilds its buckets
    buckets = len(logged.get("rebuilt_bucket_sizes", logged["bucket_sizes"]).split(", "))
    return times.median().item(), buckets


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="one timed step, one bucket size (smoke test: times nothing well)")
    parser.add_argument("--out", help="folder for the plot (default benchmarks/results)")
    args = parser.parse_args(argv)
    caps = [0.25] if args.quick else [0.1, 0.25, 0.5, 1, 2, 4, 25]
    steps = 1 if args.quick else args.steps

    common.header(f"DDP step time vs bucket_cap_mb: 12 x Linear(256, 256), global batch {GLOBAL_BATCH}, {args.ranks} ranks")
    torch.set_num_threads(1)
    single = common.median(step_times(make_model(), GLOBAL_BATCH, steps))
    torch.set_num_threads(common.cores())
    single_all = common.median(step_times(make_model(), GLOBAL_BATCH, steps))
    rows = [["no DDP, 1 process, 1 thread", "-", f"{single * 1e3:.2f}"],
            [f"no DDP, 1 process, {common.cores()} threads", "-", f"{single_all * 1e3:.2f}"]]
    points = []
    for cap in caps:
        median, buckets = course.launch(ddp_job, args.ranks, cap, steps, show=None, timeout=600)[0]
        points.append((cap, median))
        rows.append([f"DDP, bucket_cap_mb={cap}", buckets, f"{median * 1e3:.2f}"])
    common.table(["setup", "buckets", "median step ms"], rows)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([c for c, _ in points], [t * 1e3 for _, t in points], marker="o", label=f"DDP, {args.ranks} ranks")
    ax.axhline(single * 1e3, color="grey", linestyle="--", label="one process, 1 thread")
    ax.axhline(single_all * 1e3, color="black", linestyle=":", label=f"one process, {common.cores()} threads")
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("median step time (ms)")
    ax.set_title("DDP step time vs bucket size")
    ax.legend()
    common.save_plot(fig, "ddp_step_vs_bucket.png", args.out)


if __name__ == "__main__":
    main()
