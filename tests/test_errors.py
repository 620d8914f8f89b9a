"""The error helpers: an error in one line, and the user's own code's errors turned into ours."""

from __future__ import annotations

import pytest

from autotune.errors import BadInput, WorkloadError, first_line, user_code


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
