"""What the capstone's planner models without a GPU, measured on one.

The planner (course/parallel/planner.py) needs the bytes one transformer block keeps for backward,
per token and per hidden feature. CI has no GPU, so it traces CUDA's autograd formulas under
FakeTensorMode (``kernels="cuda"``). On a machine with a CUDA GPU this script runs the same bf16
blocks for real and prints, for Llama 3 8B / 70B / 405B shapes:

1. the coefficient traced (fake CUDA) beside the one measured on the GPU, counted two ways:
   the saved-tensor hooks (what autograd keeps) and the caching allocator's bytes (what stays
   allocated after forward, less the output);
2. which attention kernel ``F.scaled_dot_product_attention`` picks on this GPU, and what it keeps
   (the planner assumes the flash kernel);
3. a few training steps of a stack of blocks: the allocator's peak of allocated bytes beside its
   peak of reserved bytes (torchtitan reports ``max_memory_reserved``; the planner predicts tensors),
   with the default allocator and with ``expandable_segments:True``.

Run: ``python benchmarks/gpu_memory.py`` (prints a figure per line; exits with a message without a
GPU). Figures measured with it are quoted in notebook 18 and benchmarks/README.md.
"""

import argparse
import json
import os
import subprocess
import sys

import torch

from course.observe.memory import saved_activation_bytes
from course.parallel import planner

MODELS = {"8B": planner.LLAMA3_8B, "70B": planner.LLAMA3_70B, "405B": planner.LLAMA3_405B}


def attention_kernels(out) -> list:
    """The names of the attention backward nodes in ``out``'s graph (which kernel forward ran)."""
    seen, names, todo = set(), set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "Attention" in type(node).__name__:
            names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return sorted(names)


def measured(model, seq: int, **kwargs) -> dict:
    """One block of ``model`` on the GPU: the saved-tensor hooks' bytes and the allocator's bytes
    kept after forward (less the output), both per token per hidden feature, and the attention kernel."""
    torch.cuda.empty_cache()
    head_dim = model.hidden // model.heads
    block, modules, x = planner.block_of(model, seq, head_dim, "cuda", **kwargs)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    saved, out = saved_activation_bytes(block, modules, x)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    width = seq * model.hidden
    row = {"hooks": saved / width, "allocator": (kept + x.untyped_storage().nbytes()) / width,
           "attention": attention_kernels(out)}
    del block, modules, x, out
    return row


def coefficients(seq: int) -> list:
    rows = []
    for name, model in MODELS.items():
        for label, kwargs in [("GQA", {}), ("K/V repeated", {"repeat_kv": True}),
                              ("fp32 RMSNorm", {"fp32_norm": True})]:
            fake = planner.activation_coefficient(model, "cuda", **kwargs)
            gpu = planner.activation_coefficient(model, "gpu", seq=seq, **kwargs)
            row = measured(model, seq, **kwargs)
            sdpa = measured(model, seq, sdpa=True, **kwargs)
            rows.append({"model": name, "block": label, "fake cuda": fake, "gpu": gpu, **row,
                         "sdpa hooks": sdpa["hooks"], "sdpa attention": sdpa["attention"]})
            print(f"{name:>4} {label:<13} fake {fake:6.2f}  gpu {gpu:6.2f}  allocator {row['allocator']:6.2f}"
                  f"  {row['attention']}  | via SDPA {sdpa['hooks']:6.2f} {sdpa['attention']}", flush=True)
        for recompute in ("selective", "full"):
            fake = planner.activation_coefficient(model, "cuda", recompute=recompute)
            gpu = planner.activation_coefficient(model, "gpu", recompute=recompute, seq=seq)
            rows.append({"model": name, "block": recompute, "fake cuda": fake, "gpu": gpu})
            print(f"{name:>4} {recompute:<13} fake {fake:6.2f}  gpu {gpu:6.2f}", flush=True)
        torch.cuda.empty_cache()
    return rows


def training(layers: int, seq: int, steps: int = 3) -> dict:
    """``steps`` steps (forward, backward, AdamW) of ``layers`` bf16 blocks of Llama 3 8B's shape, one
    sequence of ``seq`` tokens: the allocator's peaks."""
    model = planner.LLAMA3_8B
    blocks = [planner.block_of(model, seq, model.hidden // model.heads, "cuda") for _ in range(layers)]
    params = [p for _, modules, _ in blocks for p in modules.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    x0 = blocks[0][2]
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        h = x0
        for block, _, _ in blocks:
            h = block(h)
        h.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    stats = {"layers": layers, "seq": seq, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
             "max allocated GiB": torch.cuda.max_memory_allocated() / 2**30,
             "max reserved GiB": torch.cuda.max_memory_reserved() / 2**30}
    stats["reserved / allocated"] = stats["max reserved GiB"] / stats["max allocated GiB"]
    return stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048, help="tokens per block for the coefficients")
    parser.add_argument("--training", help="(internal) run one training measurement: LAYERS,SEQ")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_memory.py measures on a CUDA GPU, and this machine has none (the planner's "
                 "figures without one: planner.activation_coefficient(model, 'cuda')).")
    if args.training:  # one allocator configuration per process: the variable is read at CUDA's start
        layers, seq = map(int, args.training.split(","))
        print(json.dumps(training(layers, seq)))
        return
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    figures = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
               "coefficients": coefficients(args.seq), "training": []}
    for conf in ("", "expandable_segments:True"):
        for layers, seq in ((4, 8192), (8, 4096)):
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
            done = subprocess.run([sys.executable, __file__, "--training", f"{layers},{seq}"], env=env,
                                  capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-2000:], flush=True)
                continue
            stats = json.loads(done.stdout.strip().splitlines()[-1])
            figures["training"].append(stats)
            print(f"training {layers} blocks x {seq} tokens, PYTORCH_CUDA_ALLOC_CONF={conf!r}: allocated "
                  f"{stats['max allocated GiB']:.2f} GiB, reserved {stats['max reserved GiB']:.2f} GiB "
                  f"({stats['reserved / allocated']:.3f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
