"""The error helpers: an error in one line, and the user's own code's errors turned into ours."""

from __future__ import annotations

import pytest

from autotune.errors import BadInput, WorkloadError, first_line, undo_on_failure, user_code


@pytest.mark.parametrize("exc,line", [
    (ValueError("bad value\nsecond line"), "ValueError: bad value"),
    (RuntimeError("  padded  \n"), "RuntimeError: padded"),
    (KeyError("k"), "KeyError: 'k'"),
    (RuntimeError(""), "RuntimeError"),
])
def test_first_line_is_the_type_and_the_first_line_of_the_message(exc, line):
    assert first_line(exc) == line


def test_user_code_turns_what_it_raises_into_our_error_chained_to_it():
    cause = ZeroDivisionError("division by zero")
    with pytest.raises(WorkloadError, match="^model\\(\\) failed: ZeroDivisionError") as info:
        with user_code(lambda exc: WorkloadError(f"model() failed: {first_line(exc)}")):
            raise cause
    assert info.value.__cause__ is cause


def test_user_code_wraps_our_own_errors_too_and_lets_interrupts_through():
    with pytest.raises(WorkloadError) as info, user_code(lambda exc: WorkloadError(first_line(exc))):
        raise BadInput("raised by the user's code, though it is one of ours")
    assert isinstance(info.value.__cause__, BadInput)
    for stop in (KeyboardInterrupt(), SystemExit(3)):
        with pytest.raises(type(stop)), user_code(lambda exc: WorkloadError(first_line(exc))):
            raise stop


def test_user_code_lets_a_block_that_raises_nothing_return():
    with user_code(lambda exc: WorkloadError(first_line(exc))):
        value = 1 + 1
    assert value == 2


@pytest.mark.parametrize("stop", [OSError("disk full"), KeyboardInterrupt(), SystemExit(1)])
def test_undo_on_failure_undoes_whatever_stops_the_block_and_lets_it_go_on(stop):
    undone = []
    with pytest.raises(type(stop)) as info, undo_on_failure(lambda: undone.append(True)):
        raise stop
    assert info.value is stop and undone == [True]


def test_undo_on_failure_undoes_a_generator_closed_at_its_yield():
    undone = []

    def writer():
        with undo_on_failure(lambda: undone.append(True)):
            yield "half written"

    steps = writer()
    next(steps)
    steps.close()
    assert undone == [True]


def test_undo_on_failure_keeps_a_block_left_normally_by_return_or_continue():
    undone = []

    def leave_early():
        with undo_on_failure(lambda: undone.append("return")):
            return 1

    for _ in range(2):
        with undo_on_failure(lambda: undone.append("continue")):
            continue
    assert leave_early() == 1 and undone == []
