"""The state machine: table-driven cases plus hypothesis properties over report sequences."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from payments.states import TERMINAL, TRANSITIONS, PaymentStatus, Verdict, decide, is_allowed

S = PaymentStatus
reports = st.sampled_from(list(PaymentStatus))


def walk(start: PaymentStatus, sequence: list[PaymentStatus]) -> list[PaymentStatus]:
    """Apply reports as process_callback does; return every state visited."""
    visited = [start]
    for report in sequence:
        decision = decide(visited[-1], report)
        if decision.verdict == Verdict.APPLY:
            visited.extend(decision.path)
    return visited


def test_the_transition_table_is_the_one_in_design_md():
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == {
        (S.CREATED, S.PENDING),
        (S.PENDING, S.SUCCEEDED),
        (S.PENDING, S.FAILED),
        (S.PENDING, S.UNKNOWN),
        (S.UNKNOWN, S.SUCCEEDED),
        (S.UNKNOWN, S.FAILED),
    }


def test_success_for_a_created_payment_walks_through_pending():
    decision = decide(S.CREATED, S.SUCCEEDED)
    assert decision.verdict == Verdict.APPLY
    assert decision.path == (S.PENDING, S.SUCCEEDED)


def test_opposite_terminal_report_is_a_conflict_not_an_overwrite():
    assert decide(S.FAILED, S.SUCCEEDED).verdict == Verdict.CONFLICT
    assert decide(S.SUCCEEDED, S.FAILED).verdict == Verdict.CONFLICT


def test_repeated_and_stale_reports_are_noops():
    assert decide(S.SUCCEEDED, S.SUCCEEDED).verdict == Verdict.NOOP
    assert decide(S.SUCCEEDED, S.PENDING).verdict == Verdict.NOOP
    assert decide(S.SUCCEEDED, S.UNKNOWN).verdict == Verdict.NOOP
    assert decide(S.UNKNOWN, S.PENDING).verdict == Verdict.NOOP
    assert decide(S.PENDING, S.CREATED).verdict == Verdict.NOOP


def test_unknown_resolves_to_either_terminal_state():
    assert decide(S.UNKNOWN, S.SUCCEEDED).path == (S.SUCCEEDED,)
    assert decide(S.UNKNOWN, S.FAILED).path == (S.FAILED,)


@given(start=reports, sequence=st.lists(reports, max_size=12))
def test_no_sequence_of_reports_skips_a_state(start, sequence):
    visited = walk(start, sequence)
    for a, b in zip(visited, visited[1:], strict=False):
        assert is_allowed(a, b), f"{a} -> {b} is not an allowed step"


@given(start=reports, sequence=st.lists(reports, max_size=12))
def test_no_sequence_of_reports_leaves_a_terminal_state(start, sequence):
    visited = walk(start, sequence)
    first_terminal = next((i for i, s in enumerate(visited) if s in TERMINAL), None)
    if first_terminal is not None:
        assert all(s == visited[first_terminal] for s in visited[first_terminal:])


@given(current=reports, report=reports)
def test_every_decision_is_consistent(current, report):
    decision = decide(current, report)
    if decision.verdict == Verdict.APPLY:
        assert decision.target == report
        assert current not in TERMINAL
    else:
        assert decision.path == ()
    if decision.verdict == Verdict.CONFLICT:
        assert current in TERMINAL and report in TERMINAL and current != report
