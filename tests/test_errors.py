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


@pytest.mark.parametrize("error,line", [
    (BadInput("must be at least 1", field="target_batch", value=0, limit=1, fix="e.g. 1024"),
     "target_batch 0 must be at least 1, e.g. 1024"),
    (BadInput("is not a size", field="memory_budget", value="12XB", fix="give one such as 80GiB"),
     "memory_budget '12XB' is not a size: give one such as 80GiB"),
    (BadInput(": folder /x does not exist", field="storage", value="sqlite:////x/a.db"),
     "storage 'sqlite:////x/a.db': folder /x does not exist"),
    (BadInput("{tune} needs {tune=True}", field="storage", fix="add {tune=True}, or drop {storage}"),
     "tune needs tune=True: add tune=True, or drop storage"),
    (BadInput("{parallel='fsdp'} and {device='estimate:H100-80GB'}"),
     "parallel='fsdp' and device='estimate:H100-80GB'"),
    (BadInput("a dict {'a': 1} and {not a setting} and {x=not_a_literal}"),
     "a dict {'a': 1} and {not a setting} and {x=not_a_literal}"),
    (BadInput("plain words, no field"), "plain words, no field"),
])
def test_a_bad_input_is_data_said_in_one_line_in_the_librarys_terms(error, line):
    """Each kind of message: FIELD VALUE PROBLEM: FIX, a problem that says where itself, mentions of settings."""
    assert str(error) == line and "\n" not in str(error)


def test_a_bad_input_holds_its_data_and_a_front_end_says_it_in_its_own_terms():
    from autotune.errors import NOTHING, Terms

    error = BadInput("must be one of ddp, fsdp", field="parallel", value="zero", choices=("ddp", "fsdp"),
                     fix="or drop {parallel}")
    assert (error.field, error.value, error.choices, error.limit) == ("parallel", "zero", ("ddp", "fsdp"), None)
    assert error.facts() == {"choices": ["ddp", "fsdp"], "fix": "or drop parallel"}
    loud = Terms(name=str.upper, given=lambda name, value: f"{name.upper()}:{value}", shown=lambda v: f"<{v}>")
    assert error.say(loud) == "PARALLEL <zero> must be one of ddp, fsdp: or drop PARALLEL"
    assert error.facts(loud)["fix"] == "or drop PARALLEL"
    assert BadInput("x").value is NOTHING and BadInput("x").facts() == {} and BadInput("x").exit_code == 2
    assert isinstance(error, ValueError)  # a caller's except ValueError still catches it


def test_every_autotune_error_says_its_mentions_in_a_front_ends_terms():
    from autotune.errors import DoesNotFit, Terms, mention

    flags = Terms(name=lambda n: "--" + n.replace("_", "-"), given=lambda n, v: f"--{n} {v}", shown=repr)
    error = DoesNotFit("give {memory_budget} more, or " + mention("parallel", "fsdp"))
    assert str(error) == "give memory_budget more, or parallel='fsdp'"
    assert error.say(flags) == "give --memory-budget more, or --parallel fsdp"
    assert mention("--at") == "--at"  # a name already a flag stays one


def test_an_error_of_the_users_code_is_said_as_written():
    from autotune.errors import Terms

    error = WorkloadError("model() failed: KeyError: '{batch}' at {device='x'}")
    flags = Terms(name=lambda n: "--" + n, given=lambda n, v: f"--{n} {v}", shown=repr)
    assert str(error) == error.say(flags) == "model() failed: KeyError: '{batch}' at {device='x'}"
