"""How the command line names the library's settings: ``memory_budget`` is ``--memory-budget``.

Errors are data (:class:`autotune.errors.BadInput`: the field, the value, the fix); the command line says them in
its own terms with :data:`CLI`, made from :func:`flag_name`, the one place a setting's flag is named.
"""

from __future__ import annotations

from typing import Any

from ..errors import Terms

#: Settings whose flag is not their name with dashes (the API's ``workload`` is ``--probe``).
FLAGS = {"workload": "--probe"}


def flag_name(field: str) -> str:
    """The flag that sets ``field``: ``memory_budget`` -> ``--memory-budget`` (a flag stays as it is)."""
    if field.startswith("-"):
        return field
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def _given(field: str, value: Any) -> str:
    """A setting given a value, as typed: ``--uniform`` (a switch on; every value of ``uniform`` but False and
    None is the switch), ``--device estimate``."""
    flag = flag_name(field)
    if value is True or (field == "uniform" and value not in (False, None)):
        return flag
    if value is False or value is None:
        return f"no {flag}"
    return f"{flag} {value}"


#: The command line's terms: flags, and values as Python shows them.
CLI = Terms(name=flag_name, given=_given, shown=repr)
