"""The client's view of a job's data plan (client/_plans.py): where two chains first decide a step
differently, a checkpoint checked against the plan now, two fingerprints for one phase, and the
servers of a target compared."""

from __future__ import annotations

import pytest
from tokenfeed.client import JobMismatch, PlanRewritten
from tokenfeed.client._plans import PlanWatch, at, check_resume, first_difference

A = ((0, "a0"), (40, "a1"))


def test_the_phase_in_force_decides_a_step():
    assert at(A, 0) == "a0" and at(A, 39) == "a0" and at(A, 40) == "a1" and at(A, 10**9) == "a1"
    assert at((), 5) is None


@pytest.mark.parametrize(
    "other, first",
    [
        (A, None),
        (((0, "a0"),), 40),  # a phase one of them lacks
        (((0, "a0"), (40, "a1"), (90, "a2")), 90),  # an amendment for later steps
        (((0, "a0"), (30, "b1")), 30),  # another phase start
        (((0, "b0"), (40, "a1")), 0),  # another seed or sources: from step 0
    ],
)
def test_first_difference_is_the_first_step_decided_otherwise(other, first):
    assert first_difference(A, other) == first
    assert first_difference(other, A) == first


def test_a_checkpoint_resumes_on_a_plan_amended_after_its_steps_only():
    read = ((0, "a0"), (40, "a1"))  # steps 0..59 read
    check_resume("j", read, 60, ((0, "a0"), (40, "a1"), (60, "a2")))
    check_resume("j", read, 60, A)
    with pytest.raises(PlanRewritten, match="step 50") as e:
        check_resume("j", read, 60, ((0, "a0"), (40, "a1"), (50, "x")))
    assert e.value.step == 50
    with pytest.raises(PlanRewritten, match="step 0"):
        check_resume("j", read, 60, ((0, "z0"), (40, "a1")))
    assert isinstance(e.value, JobMismatch)  # never retried, as any two definitions of a job


def test_two_fingerprints_for_one_phase_are_refused():
    watch = PlanWatch()
    assert watch.saw("j", 3, 0, "a0", "s1") is True
    assert watch.saw("j", 4, 0, "a0", "s2") is False
    assert watch.saw("j", 40, 40, "a1", "s1") is True
    with pytest.raises(JobMismatch, match="two plans"):
        watch.saw("j", 41, 40, "b1", "s2")
    assert watch.links("j", 40) == ((0, "a0"),)
    assert watch.links("j", 41) == ((0, "a0"), (40, "a1"))


def test_servers_compared_remember_the_first_step_they_differ_until_they_agree():
    watch = PlanWatch()
    assert watch.compare("j", {"s1": A, "s2": A, "s3": A}) is None
    step, why = watch.compare("j", {"s1": A, "s2": ((0, "a0"),), "s3": A})
    assert step == 40 and "s2" in why
    assert watch.conflict("j") == (step, why)
    assert watch.compare("j", {"s1": A, "s2": A}) is None
    assert watch.conflict("j") is None
