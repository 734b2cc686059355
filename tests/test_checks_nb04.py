"""Notebook 04's checks reject plausible wrong answers with a useful hint."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_reduce  # as a notebook may import it: the check must see it too
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import _compress_hook  # a private helper, by name

from course.checks import nb04


@pytest.mark.parametrize(
    "answer, hint",
    [
        (1, "first iteration only"),
        (3, "parameter that crosses the cap goes into it"),
        (6, "parameters share buckets"),
        (5, "order their gradients are ready"),
        (2.0, "whole number"),
        ("2", "whole number"),
    ],
)
def test_n_buckets_rejects_wrong_answers(answer, hint):
    feedback = nb04.n_buckets(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def _no_average(process_group, bucket):
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer.to(torch.bfloat16), async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


def _no_compression(process_group, bucket):
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _fp16_instead(process_group, bucket):
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer.to(torch.float16).div_(2), async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


def _waits_and_returns_a_tensor(process_group, bucket):
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size())
    dist.all_reduce(compressed)
    return bucket.buffer().copy_(compressed)


def _returns_zeros(process_group, bucket):
    fut = torch.futures.Future()
    fut.set_result(torch.zeros_like(bucket.buffer()))
    dist.all_reduce(bucket.buffer().to(torch.bfloat16), group=process_group, async_op=True)
    return fut


def _blocking_then_a_done_future(process_group, bucket):  # right values, but backward waits in the hook
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    dist.all_reduce(compressed, group=process_group)
    fut = torch.futures.Future()
    fut.set_result(buffer.copy_(compressed))
    return fut


def _async_then_waits(process_group, bucket):
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    work = dist.all_reduce(compressed, group=process_group, async_op=True)
    work.wait()  # "async" in name only
    return work.get_future().then(lambda fut: buffer.copy_(fut.value()[0]))


def _ignores_the_group(process_group, bucket):  # always the default group
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    return dist.all_reduce(compressed, async_op=True).get_future().then(lambda fut: buffer.copy_(fut.value()[0]))


def _float32_too(process_group, bucket):  # a bfloat16 all-reduce, plus the float32 one it should replace
    buffer = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(buffer.to(torch.bfloat16), group=process_group, async_op=True)
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _wrong_parameter_name(state, grads):
    return dist.all_reduce(grads.buffer(), async_op=True).get_future()


def _sums_then_divides(process_group, bucket):  # right on ordinary gradients, overflows on huge ones
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer.to(torch.bfloat16), async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0] / dist.get_world_size())
        return buffer

    return fut.then(decompress)


def _renamed_builtin(process_group, bucket):  # the built-in hook under another name
    return default_hooks.bf16_compress_hook(process_group, bucket)


def _wrapped_allreduce(process_group, bucket):  # PyTorch's bf16 wrapper around its allreduce hook
    return default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)(process_group, bucket)


def _private_helper_by_name(process_group, bucket):  # PyTorch's bf16 hook body, imported by name
    return _compress_hook(torch.bfloat16, process_group, bucket)


def _own_fp32_hook(process_group, bucket):
    buffer = bucket.buffer().div_(dist.get_world_size(process_group))
    return dist.all_reduce(buffer, group=process_group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _own_hook_in_pytorchs_wrapper(process_group, bucket):  # the bf16 cast and copy back done by PyTorch
    return default_hooks.bf16_compress_wrapper(_own_fp32_hook)(process_group, bucket)


def _divides_by_a_fixed_2(process_group, bucket):  # right on 2 ranks only
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(2)
    return dist.all_reduce(compressed, group=process_group, async_op=True).get_future().then(lambda fut: buffer.copy_(fut.value()[0]))


def _raises(process_group, bucket):
    raise ValueError("typo")


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_no_average, "divide by the world size to average"),
        (_sums_then_divides, "*before* the all_reduce"),
        (_divides_by_a_fixed_2, "not by a fixed number"),
        (default_hooks.bf16_compress_hook, "PyTorch's own hook"),
        (_renamed_builtin, "calls PyTorch's own hook"),
        (_wrapped_allreduce, "calls PyTorch's own hook"),
        (_private_helper_by_name, "calls PyTorch's own hook"),
        (_own_hook_in_pytorchs_wrapper, "calls PyTorch's own hook"),
        (default_hooks.bf16_compress_wrapper(_own_fp32_hook), "that is PyTorch's own hook"),
        (_no_compression, "ran in float32: cast the bucket's buffer to torch.bfloat16"),
        (_fp16_instead, "ran in float16"),
        (_waits_and_returns_a_tensor, "DDP wants a torch.futures.Future back"),
        (_returns_zeros, "copy the result back into the float32 buffer"),
        (_wrong_parameter_name, "must be named `bucket`"),
        (_raises, "a rank failed: ValueError: typo"),
        (_blocking_then_a_done_future, "the hook waits for its all-reduce"),
        (_async_then_waits, "the hook waits for its all-reduce"),
        (_ignores_the_group, "all-reduce in that group"),
        (_float32_too, "in bfloat16 only"),
        (42, "write a function"),
    ],
)
def test_bf16_hook_rejects_wrong_answers(answer, hint):
    feedback = nb04.bf16_hook(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def _imported_all_reduce(process_group, bucket):
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(process_group))
    fut = all_reduce(compressed, group=process_group, async_op=True).get_future()
    return fut.then(lambda fut: buffer.copy_(fut.value()[0]))


def _imported_blocking_all_reduce(process_group, bucket):
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size(process_group))
    all_reduce(compressed, group=process_group)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer().copy_(compressed))
    return fut


def test_bf16_hook_watches_an_all_reduce_imported_by_name():
    assert nb04.bf16_hook(_imported_all_reduce).status == "correct"
    feedback = nb04.bf16_hook(_imported_blocking_all_reduce)
    assert feedback.status == "wrong" and "waits for its all-reduce" in feedback.message, feedback


def test_returning_the_bf16_result_without_casting_back_is_fine():
    # DDP copies the hook's result into its float32 bucket itself, so this is correct too.
    def hook(process_group, bucket):
        compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size())
        return dist.all_reduce(compressed, group=process_group, async_op=True).get_future().then(lambda fut: fut.value()[0])

    assert nb04.bf16_hook(hook).status == "correct"
