"""How much does course.observe.tracing slow down a DDP step? (A benchmark, not a test.)

    python benchmarks/tracer_overhead.py [--repeats 5] [--steps 30] [--warmup 5] [--quick]

For a few models, 2 ranks run DDP training steps on the plain "gloo" backend and on
the "traced" backend (gloo with a recorder in front). Each repeat is a fresh launch;
a repeat's figure is the median step time of its rank 0, after warm-up steps; the
table shows the median over repeats. Absolute times depend on the machine and on
what else runs on it; compare the columns of one run.
"""

import argparse
import statistics
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
from course.observe import tracing  # noqa: E402,F401  (registers the "traced" backend)

MODELS = {
    # name: (layer widths, bucket_cap_mb, batch)
    "MLP 10-64-64-5, 2 buckets": ([10, 64, 64, 5], 0.01, 8),
    "MLP 10-1000-1000-5, 2 buckets": ([10, 1000, 1000, 5], 1, 2),
    "12 x Linear(256,256), 12 buckets": ([256] * 13, 0.25, 32),
}


def _model(widths):
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _steps(rank, world_size, widths, cap, batch, steps, warmup):
    ddp = DDP(_model(widths), bucket_cap_mb=cap)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(batch, widths[0])
    traced = dist.get_backend() == "traced"
    times = []
    for step in range(warmup + steps):
        if step == warmup and traced:
            tracing.clear()
        dist.barrier()
        start = time.perf_counter()
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    all_reduces = sum(e.op == "all_reduce" for e in tracing.collectives()) if traced else 0
    return statistics.median(times), all_reduces


def _bare_all_reduces(rank, world_size, n, warmup):
    """No DDP: n all_reduces of one float, the tracer's cost per collective."""
    t = torch.ones(1)
    for _ in range(10 * warmup):
        dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    return (time.perf_counter() - start) / n, n


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="launches per model and backend (default 5)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per launch (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--quick", action="store_true", help="one launch of 2 steps, smallest model only (smoke test: times nothing well)")
    args = parser.parse_args(argv)
    models = MODELS
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 2, 1
        models = dict(list(MODELS.items())[:1])

    common.header(f"Tracer overhead: 2 ranks x 1 thread, median of {args.repeats} launches x {args.steps} steps")
    header = f"{'model':<34} {'gloo ms/step':>12} {'traced ms/step':>15} {'overhead':>9} {'per all_reduce':>15}"
    print(header)
    print("-" * len(header))
    jobs = {name: (_steps, (widths, cap, batch, args.steps, args.warmup)) for name, (widths, cap, batch) in models.items()}
    jobs["dist.all_reduce(1 float), no DDP"] = (_bare_all_reduces, (20 * args.steps, args.warmup))
    for name, (job, job_args) in jobs.items():
        medians = {}
        reduces_per_step = 0
        for _ in range(args.repeats):
            for backend in ("gloo", "traced"):  # interleaved, so that load changes hit both
                seconds, reduces = course.launch(job, 2, *job_args, backend=backend, show=None, timeout=600)[0]
                medians.setdefault(backend, []).append(seconds)
                if reduces and job is _steps:
                    reduces_per_step = reduces / args.steps
        plain = statistics.median(medians["gloo"]) * 1e3
        traced = statistics.median(medians["traced"]) * 1e3
        collectives = max(reduces_per_step, 1)
        per_op = (traced - plain) / collectives * 1e3
        print(f"{name:<34} {plain:>12.2f} {traced:>15.2f} {100 * (traced - plain) / plain:>8.1f}% {per_op:>12.0f} us")


if __name__ == "__main__":
    main()
