"""The library's own habits, held over every module: short functions, broad excepts that are few and say why, an
Accumulator composed of parts rather than configured by a long list of keywords, and one type for one measurement
of the fit rule."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"
MAX_FUNCTION_LINES = 60
MAX_BROAD_EXCEPTS = 10
MAX_ACCUMULATOR_PARAMETERS = 8
BROAD = {"Exception", "BaseException"}
MEASUREMENT_MODULES = {"devices", "base", "measurement"}  # where a module imports the device's Measurement from


def long_functions(source: str, where: str) -> list[str]:
    """``where:name (N lines)`` for each function or method of ``source`` over :data:`MAX_FUNCTION_LINES`."""
    return [f"{where}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def broad_excepts(source: str, where: str) -> list[tuple[str, bool]]:
    """``(where:line, says why)`` for each bare ``except:`` or ``except Exception``/``BaseException`` (alone or
    in a tuple) of ``source``; it says why when a comment ends its line."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ExceptHandler):
            continue
        caught = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
        if node.type is None or any(isinstance(c, ast.Name) and c.id in BROAD for c in caught):
            found.append((f"{where}:{node.lineno}", "#" in lines[node.lineno - 1]))
    return found


def constructor_parameters(source: str, class_name: str) -> list[str]:
    """The parameters of ``class_name.__init__`` in ``source``, ``self`` left out (``*args`` and ``**kwargs``
    count as one each)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    a = item.args
                    named = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]
                    return [arg.arg for arg in named][1:]
    raise LookupError(f"no {class_name}.__init__ in the source")


def measurement_fields(source: str, where: str) -> list[str]:
    """``where:Class.attribute`` for each class attribute of ``source`` annotated with the device's ``Measurement``
    (in a module that imports it from :mod:`autotune.devices`)."""
    tree = ast.parse(source)
    if not any(isinstance(node, ast.ImportFrom) and (node.module or "").rpartition(".")[2] in MEASUREMENT_MODULES
               and any(name.name == "Measurement" for name in node.names) for node in ast.walk(tree)):
        return []
    return [f"{where}:{cls.name}.{item.target.id}" for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
            for item in cls.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            and re.search(r"\bMeasurement\b", ast.unparse(item.annotation))]


def _modules() -> list[tuple[str, str]]:
    return [(path.read_text(), str(path.relative_to(PACKAGE.parent))) for path in sorted(PACKAGE.rglob("*.py"))]


def test_no_function_is_over_60_lines():
    assert [f for source, where in _modules() for f in long_functions(source, where)] == []


def test_only_the_public_api_defines_a_function_named_probe():
    """``autotune.probe`` is the verb; the store's cache around the search and the search have names of their own
    (``probe_through_store``, ``find_max_micro_batch``), so a reader of the main path knows which one runs."""
    defined = [where for source, where in _modules() for node in ast.parse(source).body
               if isinstance(node, ast.FunctionDef) and node.name == "probe"]
    assert defined == ["autotune/api.py"]


def test_at_most_ten_broad_excepts_and_each_says_why():
    found = [e for source, where in _modules() for e in broad_excepts(source, where)]
    assert len(found) <= MAX_BROAD_EXCEPTS, found
    assert [where for where, says_why in found if not says_why] == []


def test_the_checks_see_a_long_function_and_a_broad_except_without_a_reason():
    def function(name: str, lines: int) -> str:
        return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(lines - 1))

    source = function("long", MAX_FUNCTION_LINES + 1) + function("short", MAX_FUNCTION_LINES)
    assert long_functions(source, "m.py") == [f"m.py:long ({MAX_FUNCTION_LINES + 1} lines)"]
    source = textwrap.dedent("""\
        try:
            pass
        except BaseException:
            raise
        try:
            pass
        except (OSError, Exception):  # the user's code: anything
            pass
        try:
            pass
        except:
            pass
        try:
            pass
        except OSError:
            pass
        """)
    assert broad_excepts(source, "m.py") == [("m.py:3", False), ("m.py:7", True), ("m.py:11", False)]


def test_a_trial_is_the_one_type_that_holds_the_devices_measurement():
    """One measurement of the fit rule is one :class:`~autotune.results.probe.Trial`, which holds the device's
    ``Measurement`` of it in memory (a field typed loosely: results import no device code): no other type is
    annotated with the device's ``Measurement`` to pair a trial with its measurement."""
    from dataclasses import fields

    from autotune.results.probe import Trial

    assert "measurement" in {f.name for f in fields(Trial)}
    assert [f for source, where in _modules() for f in measurement_fields(source, where)] == []


def test_the_measurement_check_sees_a_type_wrapping_a_trial():
    source = textwrap.dedent("""\
        from ..devices.base import Device, Measurement
        from ..results.probe import Trial

        @dataclass(frozen=True)
        class MeasuredTrial:
            trial: Trial
            measurement: Measurement | None = None
            seconds: float = 0.0

        class Runner:
            last: "Measurement"
        """)
    assert measurement_fields(source, "m.py") == ["m.py:MeasuredTrial.measurement", "m.py:Runner.last"]
    assert measurement_fields(source.replace("Device, Measurement", "Device"), "m.py") == []


def test_the_accumulator_constructor_takes_at_most_8_parameters():
    source = (PACKAGE / "training" / "accumulate.py").read_text()
    parameters = constructor_parameters(source, "Accumulator")
    assert len(parameters) <= MAX_ACCUMULATOR_PARAMETERS, parameters


def test_the_parameter_count_sees_a_constructor_of_nine():
    source = textwrap.dedent("""\
        class Accumulator:
            def helper(self, a, b, c, d, e, f, g, h, i, j):
                pass

            def __init__(self, model, optimizer, schedule, *args, loss, items=None, max_norm=None, parts=(), **old):
                pass
        """)
    assert constructor_parameters(source, "Accumulator") == [
        "model", "optimizer", "schedule", "loss", "items", "max_norm", "parts", "args", "old"]
    assert len(constructor_parameters(source, "Accumulator")) > MAX_ACCUMULATOR_PARAMETERS


#: The modules that say errors to users: none of them substitutes text with a regular expression, but these.
FRONT_ENDS = ("autotune/cli/", "autotune/serve/", "autotune/errors.py", "autotune/api.py")
#: Front-end modules whose substitution touches an error's text, and why that is not a rewrite of terms.
SUBSTITUTIONS_ALLOWED = {
    "autotune/serve/jobs.py": "bare(): a job's error loses this machine's folders before a client sees it",
}
_REGEX_CALLS = {"compile", "sub", "subn", "match", "fullmatch", "search", "findall", "finditer", "split"}


def _settings() -> set[str]:
    """Every setting a front end takes: the service's plan body and the library's plan and probe requests."""
    import inspect

    from autotune.planning.requests import plan_request, probe_request
    from autotune.serve.bodies import PlanRequest

    keywords = set(inspect.signature(plan_request).parameters) | set(inspect.signature(probe_request).parameters)
    return (set(PlanRequest.model_fields) | keywords) - {"env", "group", "at"}


def error_rewrites(source: str, where: str, settings: set[str]) -> list[str]:
    """``where:line why`` for each way ``source`` could rewrite error text with a regular expression: a function
    named ``in_..._terms``, a pattern built by a call (``"|".join(NAMES)``), a pattern that names a setting, a
    substitution (``re.sub``, ``pattern.sub``) in a front end (:data:`FRONT_ENDS`) but those allowed."""
    import re

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and re.fullmatch(r"in_\w+_terms", node.name):
            found.append(f"{where}:{node.lineno} defines {node.name}")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        on_re = isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
        if node.func.attr in ("sub", "subn") and where.startswith(FRONT_ENDS) and where not in SUBSTITUTIONS_ALLOWED \
                and (on_re or node.args):
            found.append(f"{where}:{node.lineno} substitutes with a regular expression")
        if not (on_re and node.func.attr in _REGEX_CALLS and node.args):
            continue
        pattern = node.args[0]
        if any(isinstance(part, ast.Call) for part in ast.walk(pattern)):
            found.append(f"{where}:{node.lineno} builds its pattern by a call")
        for text in (c.value for c in ast.walk(pattern) if isinstance(c, ast.Constant) and isinstance(c.value, str)):
            words = text.replace("\\b", " ")  # a pattern's word boundaries, \bdevice=
            named = sorted(s for s in settings if re.search(rf"(?<![\w-]){s}(?![\w-])", words))
            if named:
                found.append(f"{where}:{node.lineno} names the setting {named[0]} in a pattern")
    return found


def test_no_regular_expression_rewrites_an_error_message():
    """Errors are data each front end says in its own terms: no module rewrites another's text with a regex."""
    settings = _settings()
    assert [f for source, where in _modules() for f in error_rewrites(source, where, settings)] == []
    for where in SUBSTITUTIONS_ALLOWED:
        assert error_rewrites((PACKAGE.parent / where).read_text(), "autotune/cli/x.py", settings), where  # in use


@pytest.mark.parametrize("source", [
    'import re\n_P = re.compile(r"\\b(" + "|".join(NAMES) + r")\\b")\n',
    'import re\ndef say(m):\n    return re.sub(r"\\bdevice=\'([^\']*)\'", r"--device \\1", m)\n',
    'def in_flag_terms(m):\n    return m\n',
    'import re\ndef say(m):\n    return _SWITCH.sub(lambda x: "--" + x.group(1), m)\n',
])
def test_the_rewrite_check_sees_what_the_front_ends_did_before(source):
    assert error_rewrites(source, "autotune/cli/__init__.py", _settings())
    assert error_rewrites('import re\nP = re.compile(r"\\bdevice=(\\w+)")\n', "autotune/report/x.py", _settings())
