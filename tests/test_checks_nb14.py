"""Notebook 14's checks reject plausible wrong answers with a useful hint."""

import pytest

from course.checks import nb14


P, M = 4, 5  # Exercise 1's first schedule: the bubble is (p - 1) / (m + p - 1) = 3/8


@pytest.mark.parametrize("answer", [lambda p, m: (p - 1) / (m + p - 1), lambda p, m: 1 - m / (m + p - 1)])
def test_bubble_fraction_accepts_the_formula(answer):
    assert nb14.bubble_fraction(answer).status == "correct"


def _stub(p, m):
    ...


def test_bubble_fraction_says_not_attempted_for_the_stub():
    assert nb14.bubble_fraction(_stub).status == "todo"


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda p, m: (p - 1) / m, "Megatron-LM and the Ultra-Scale Playbook call the bubble fraction"),
        (lambda p, m: (p - 1) / p, "bubble with a single micro-batch"),
        (lambda p, m: (p - 1) / (m + p), "off by one"),
        (lambda p, m: m / (m + p - 1), "*busy*"),
        (lambda p, m: 100 * (p - 1) / (m + p - 1), "as a percentage"),
        (lambda p, m: 0.1, "count how many forwards the forward phase lasts"),
        (lambda p, m: "3/8", "return a number"),
        (3 / 8, "write a function of p (stages) and m (micro-batches)"),
        # right at p = 4, m = 5 only: a constant, a table, a formula that fits one point
        (lambda p, m: 3 / 8, "it matches at p = 4, m = 5 but not everywhere"),
        (lambda p, m: {(4, 5): 0.375}[p, m], "your function fails for p = 1, m = 3: KeyError"),
        (lambda p, m: (p - 1) / (2 * m - 2), "your function fails for p = 2, m = 1: ZeroDivisionError"),
        (lambda p, m: (p - 1) ** 2 / 24, "it matches at p = 4, m = 5 but not everywhere"),
        (lambda p, m: (m - 2) / (m + p - 1), "it matches at p = 4, m = 5 but not everywhere"),  # m and p swapped
    ],
)
def test_bubble_fraction_rejects_wrong_answers(answer, hint):
    feedback = nb14.bubble_fraction(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


@pytest.mark.parametrize(
    "formula",
    [
        "1 / (p - 1)",
        "(p - 2) / m",
        "(p - 1) / m",
        "(p - 1) / (m + p)",
        "(p - 1) / (m + p - 2)",
        "(p - 2) / (m + p - 2)",
        "p / (m + p - 1)",
        "p / (m + p)",
        "(m - 1) / (m + p - 1)",  # m and p swapped
        "1 / p",
        "1 / m",
        "(p - 1) / (2 * m + p - 1)",
    ],
)
def test_bubble_fraction_rejects_plausible_wrong_formulas(formula):
    """With p = 4, m = 5 no plausible wrong formula lands within the check's tolerance of 3/8, and the other
    schedules reject it too."""
    assert abs(eval(formula, {"p": P, "m": M}) - 3 / 8) > 0.02, formula
    answer = eval(f"lambda p, m: {formula}")
    assert nb14.bubble_fraction(answer).status == "wrong", formula


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
    feedback = nb14.one_f_one_b(answer)
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
def test_bytes_per_step_rejects_wrong_answers(answer, hint, launch_once):
    launch_once(nb14)  # one traced run for all the answers: what rank 0 sends is the same every run
    feedback = nb14.bytes_per_step(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_bubble_fraction_rejects_a_table_of_every_fixed_point():
    table = {(p, m): nb14._gpipe_bubble(p, m) for p, m in nb14.POINTS}  # right wherever the check always looks
    feedback = nb14.bubble_fraction(lambda p, m: table[p, m])
    assert feedback.status == "wrong" and "KeyError" in feedback.message, feedback
    drawn = {point for _ in range(50) for point in nb14._points()[len(nb14.POINTS):]}
    assert len(drawn) > 10 and not drawn & set(nb14.POINTS)  # a fresh point each call, never a fixed one
