"""Notebook 06's checks reject plausible wrong answers with a hint that points at the mistake."""

import pytest
import torch
import torch.distributed as dist

from course.checks import nb06


# ------------------------------------------------------------------ Exercise 1: global_mean_var


def _local_only(x):
    return x.mean(0), x.var(0, unbiased=False)


def _mean_of_means(x):
    mean, var = x.mean(0), x.var(0, unbiased=False)
    dist.all_reduce(mean)
    return mean / dist.get_world_size(), var


def _sums(x):
    stats = torch.cat([x.sum(0), (x * x).sum(0), torch.tensor([len(x)], dtype=x.dtype)])
    dist.all_reduce(stats)
    c = x.shape[1]
    return stats[:c], stats[c : 2 * c], stats[-1]


def _unbiased(x):
    total, total_sq, n = _sums(x)
    mean = total / n
    return mean, (total_sq - n * mean * mean) / (n - 1)


def _mean_of_variances(x):
    total, _, n = _sums(x)
    var = x.var(0, unbiased=False)
    dist.all_reduce(var)
    return total / n, var / dist.get_world_size()


def _per_sample_mean(x):
    total, total_sq, n = _sums(x)
    return total / n, total_sq / n


def _single_tensor(x):
    total, total_sq, n = _sums(x)
    return torch.stack([total / n, total_sq / n - (total / n) ** 2])[0]


def _three_all_reduces(x):
    x = x.double()
    total, total_sq, n = x.sum(0), (x * x).sum(0), torch.tensor([float(len(x))], dtype=x.dtype)
    for t in (total, total_sq, n):  # right, but three latencies where one does
        dist.all_reduce(t)
    mean = total / n
    return mean, total_sq / n - mean * mean


def _crashes(x):
    raise RuntimeError("typo")


def _over_channels(x):
    mean = x.mean(1)
    return mean, mean


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_local_only, "only its own samples"),
        (_mean_of_means, "all_reduce the count"),
        (_unbiased, "biased variance"),
        (_mean_of_variances, "averaging the ranks' variances"),
        (_per_sample_mean, "Σx²/n - mean²"),
        (_single_tensor, "return two tensors"),
        (_over_channels, "one mean and one variance per channel"),
        (_three_all_reduces, "right, with 3 all-reduces"),
        (_crashes, "a rank failed: RuntimeError: typo"),
    ],
)
def test_global_mean_var_rejects_wrong_answers(answer, hint):
    feedback = nb06.global_mean_var(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def _float32_naive(x):
    # the loophole: Σx²/n - mean² in the input's dtype, right in float64, wrong for float32 with a large mean
    total, total_sq, n = _sums(x)
    mean = total / n
    return mean, total_sq / n - mean * mean


def test_global_mean_var_rejects_the_float32_naive_formula():
    feedback = nb06.global_mean_var(_float32_naive)
    assert feedback.status == "wrong" and "float32" in feedback.message and "float64" in feedback.message, feedback


# ------------------------------------------------------------------ Exercise 2: predict_running_means


def _independent(batches, momentum):
    running = [torch.zeros(3) for _ in batches]
    for step in range(len(batches[0])):
        running = [(1 - momentum) * r + momentum * b[step].mean(0) for r, b in zip(running, batches)]
    return running


def _broadcast_after(batches, momentum):
    return [r.clone() for r in [_independent(batches, momentum)[0]] * len(batches)]


def _synchronised(batches, momentum):
    running = torch.zeros(3)
    for step in range(len(batches[0])):
        running = (1 - momentum) * running + momentum * torch.cat([b[step] for b in batches]).mean(0)
    return [running.clone() for _ in batches]


def _momentum_swapped(batches, momentum):
    running = [torch.zeros(3) for _ in batches]
    for step in range(len(batches[0])):
        running = [running[0].clone() for _ in batches]
        running = [momentum * r + (1 - momentum) * b[step].mean(0) for r, b in zip(running, batches)]
    return running


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_independent, "start of every training forward"),
        (_broadcast_after, "the ranks do not end equal"),
        (_synchronised, "never sees the other ranks' samples"),
        (_momentum_swapped, "running_mean ← (1 - momentum)"),
        (lambda batches, momentum: [torch.zeros(3)], "one running_mean of shape"),
    ],
)
def test_predict_running_means_rejects_wrong_answers(answer, hint):
    feedback = nb06.predict_running_means(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


# ------------------------------------------------------------------ Exercise 3: input_grad


def _no_mean_term(g, x_hat, weight, invstd, sum_g, sum_g_xhat, n):
    return weight * invstd * (g - x_hat * sum_g_xhat / n)


def _no_variance_term(g, x_hat, weight, invstd, sum_g, sum_g_xhat, n):
    return weight * invstd * (g - sum_g / n)


def _no_weight(g, x_hat, weight, invstd, sum_g, sum_g_xhat, n):
    return invstd * (g - sum_g / n - x_hat * sum_g_xhat / n)


def _local_count(g, x_hat, weight, invstd, sum_g, sum_g_xhat, n):
    n = len(g)
    return weight * invstd * (g - sum_g / n - x_hat * sum_g_xhat / n)


def _one_per_channel(g, x_hat, weight, invstd, sum_g, sum_g_xhat, n):
    return (weight * invstd * (g - sum_g / n - x_hat * sum_g_xhat / n)).sum(0)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_no_mean_term, "subtract Σg / n"),
        (_no_variance_term, "subtract x_hat * Σg·x̂ / n"),
        (_no_weight, "multiply by weight"),
        (_local_count, "global count"),
        (_one_per_channel, "shaped like grad_out"),
        (lambda *args: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_input_grad_rejects_wrong_answers(answer, hint):
    feedback = nb06.input_grad(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_global_mean_var_counts_all_reduces_however_they_are_called():
    from torch.distributed import all_reduce  # a name bound before the check runs: no patch of dist sees it

    def three_all_reduces(x):
        x = x.double()
        total, total_sq, n = x.sum(0), (x * x).sum(0), torch.tensor([float(len(x))], dtype=x.dtype)
        for t in (total, total_sq, n):
            all_reduce(t)
        mean = total / n
        return mean, total_sq / n - mean * mean

    feedback = nb06.global_mean_var(three_all_reduces)
    assert feedback.status == "wrong" and "right, with 3 all-reduces" in feedback.message, feedback


def test_input_grad_hint_leads_to_the_result_without_giving_it():
    # The notebook sends a stuck student to hint(): it must point at the derivation, not state the answer.
    hint = str(nb06.input_grad.hint())
    assert "∂μ/∂x_i = 1/n" in hint and "Σ_j x̂_j = 0" in hint
    assert "g - Σg / n" not in hint and "sum_g / n" not in hint
    feedback = nb06.input_grad(lambda g, x_hat, weight, invstd, sum_g, sum_g_xhat, n: weight * invstd * g)
    assert feedback.status == "wrong" and "g - Σg / n" not in feedback.message, feedback
