"""Notebook 13's checks reject plausible wrong answers with a useful hint."""

import pytest

from course.checks import nb13


@pytest.mark.parametrize(
    "answer, hint",
    [
        (3 / 6, "(p - 1) / m compares the idle time with the *busy* time"),
        (3 / 4, "bubble with a single micro-batch"),
        (3 / 10, "off by one slot"),
        (6 / 9, "*busy*"),
        (33.3, "as a percentage"),
        (0.1, "count how many slots the step lasts"),
        ("1/3", "answer with a number"),
        (True, "answer with a number"),
    ],
)
def test_bubble_fraction_rejects_wrong_answers(answer, hint):
    feedback = nb13.bubble_fraction(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def _with_warmup(warmup_of, cooldown=True):
    """A 1F1B-like order whose warm-up length is ``warmup_of(stage, p, m)``."""

    def order(stage, p, m):
        warmup = warmup_of(stage, p, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", warmup + i), ("B", i)]
        if cooldown:
            actions += [("B", i) for i in range(m - warmup, m)]
        return actions

    return order


def _gpipe(stage, p, m):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def _returns_nothing(stage, p, m):
    [("F", i) for i in range(m)]  # builds a list but forgets to return it


def _raises(stage, p, m):
    raise ValueError("typo")


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_gpipe, "that is GPipe's order"),
        (_with_warmup(lambda s, p, m: 0), "Run more forwards before the first backward"),
        (_with_warmup(lambda s, p, m: min(p - s, m)), "One forward too many"),
        (_with_warmup(lambda s, p, m: s), "no stage can go on"),
        (_with_warmup(lambda s, p, m: p - s - 1), "does not exist"),  # forgets m < p
        (_with_warmup(lambda s, p, m: min(p - s - 1, m), cooldown=False), "run the backwards left"),
        (_returns_nothing, "return a list of ('F', i) and ('B', i) pairs"),
        (_raises, "ValueError: typo"),
    ],
)
def test_one_f_one_b_rejects_wrong_answers(answer, hint):
    feedback = nb13.one_f_one_b(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


@pytest.mark.parametrize(
    "answer, hint",
    [
        (4 * 2048, "together the m sends carry the batch once"),
        (512, "one micro-batch's activation"),
        (2 * 2048, "it sends no gradients"),
        (4 * 4224, "what data parallelism all-reduces"),
        (8 * 2048, "bits, not bytes"),
        (1000, "for every micro-batch"),
        (2048.5, "whole number"),
        (float("inf"), "whole number"),
        ("2048", "whole number"),
    ],
)
def test_bytes_per_step_rejects_wrong_answers(answer, hint):
    feedback = nb13.bytes_per_step(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback
