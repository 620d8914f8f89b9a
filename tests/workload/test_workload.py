"""Workloads and probe files: loading, errors that name the file, options."""

from __future__ import annotations

import os
import sys
import sysconfig
import textwrap

import pytest
import torch

from autotune.errors import ProbeFileError
from autotune.workload import Workload, load_workload


@pytest.mark.parametrize("name", ["mlp", "gpt", "convnet", "autotune.probes.mlp", "gpt:build_100m"])
def test_builtin_probes_load(name):
    w = load_workload(name)
    assert isinstance(w, Workload) and w.name


def test_default_is_gpt():
    assert load_workload(None).name == "gpt"


def _file(tmp_path, body: str):
    path = tmp_path / "probe_file.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_probe_file_with_function(tmp_path):
    path = _file(tmp_path, """
        import torch
        from autotune import Workload
        def small():
            return Workload(name="tiny", model=lambda: torch.nn.Linear(2, 2), batch=lambda n, g: torch.randn(n, 2),
                            loss=lambda m, b: m(b).pow(2).mean())
        build = small
    """)
    assert load_workload(path).name == "tiny"
    assert load_workload(f"{path}:small").name == "tiny"


@pytest.mark.parametrize("body,match", [
    ("x = 1\n", r"has no build\(\) function"),
    ("build = 3\n", "not a function"),
    ("def build():\n    return 42\n", r"returned int, not an autotune.Workload"),
    ("def build():\n    raise RuntimeError('no data here')\n", r"build\(\) failed: RuntimeError: no data here"),
    ("def build(:\n", "could not be imported: SyntaxError"),
])
def test_probe_file_errors_name_the_file(tmp_path, body, match):
    path = _file(tmp_path, body)
    with pytest.raises(ProbeFileError, match=match) as info:
        load_workload(path)
    assert "probe_file.py" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("spec,match", [
    ("missing_probe.py", "does not exist"),
    ("no.such.module", "neither a file nor an importable module"),
    ("mlp:nope", r"has no nope\(\) function"),
])
def test_missing_probes(spec, match):
    with pytest.raises(ProbeFileError, match=match):
        load_workload(spec)


def test_items_default_to_the_batch_size(mlp):
    batch = mlp.batch(7, torch.Generator().manual_seed(0))
    assert mlp.count_items(batch) == 7


def test_gpt_counts_real_target_tokens(gpt):
    batch = gpt.batch(16, torch.Generator().manual_seed(0))
    n = gpt.count_items(batch)
    assert 0 < n < batch["targets"].numel()  # padding is not counted
    assert n == int((batch["targets"] != -100).sum())


def test_options_are_bound_into_the_factories(gpt):
    assert gpt.choices() == [{"checkpointing": False}, {"checkpointing": True}]
    on = gpt.configure(checkpointing=True)
    assert on.model().checkpointing is True and on.chosen == {"checkpointing": True}
    with pytest.raises(ValueError, match="no option"):
        gpt.configure(flash=True)


def test_workload_validates_itself():
    with pytest.raises(ValueError, match="name"):
        Workload(name="", model=lambda: None, batch=lambda n, g: None, loss=lambda m, b: None)
    with pytest.raises(ValueError, match="callable"):
        Workload(name="x", model=3, batch=lambda n, g: None, loss=lambda m, b: None)


# -- a probe file's folder is importable -----------------------------------------------------------

_SIBLING_PROBE = """
    import colorsys
    import torch
    from autotune import Workload
    from {module} import Net

    assert hasattr(colorsys, "rgb_to_hsv")  # the standard library's, not the file beside the probe

    def build():
        def loss(model, batch):
            from {module}_loss import mean_square  # imported only when the loss first runs
            return mean_square(model(batch))
        return Workload(name="sibling", model=Net, batch=lambda n, g: torch.randn(n, 2, generator=g), loss=loss)
"""


@pytest.fixture
def clean_imports(monkeypatch):
    """sys.path and sys.modules as they were before the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _sibling_folder(tmp_path, module: str):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / f"{module}.py").write_text("import torch\nclass Net(torch.nn.Linear):\n"
                                         "    def __init__(self):\n        super().__init__(2, 1)\n")
    (folder / f"{module}_loss.py").write_text("def mean_square(x):\n    return x.pow(2).mean()\n")
    (folder / "colorsys.py").write_text("raise ImportError('a file beside the probe shadowed the standard library')\n")
    (folder / "probe.py").write_text(textwrap.dedent(_SIBLING_PROBE.format(module=module)))
    return folder


def test_a_probe_file_imports_the_module_beside_it_from_any_folder(tmp_path, monkeypatch, clean_imports):
    folder = _sibling_folder(tmp_path, "my_model_a")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    w = load_workload(str(folder / "probe.py"))
    model = w.model()
    loss = w.loss(model, w.batch(3, torch.Generator().manual_seed(0)))  # the lazy import, after loading
    assert w.name == "sibling" and loss.ndim == 0


def test_a_probe_files_folder_comes_after_the_standard_library_and_once(tmp_path, clean_imports):
    folder = _sibling_folder(tmp_path, "my_model_b")
    load_workload(str(folder / "probe.py"))
    load_workload(f"{folder / 'probe.py'}:build")
    entries = [os.path.realpath(p) for p in sys.path]
    assert entries.count(os.path.realpath(folder)) == 1
    stdlib = os.path.realpath(sysconfig.get_path("stdlib"))
    if stdlib in entries:
        assert entries.index(os.path.realpath(folder)) > entries.index(stdlib)


def test_a_probe_file_that_fails_leaves_sys_path_as_it_was(tmp_path, clean_imports):
    path = _file(tmp_path, "from no_such_sibling import Net\n")
    before = list(sys.path)
    with pytest.raises(ProbeFileError, match="No module named 'no_such_sibling'"):
        load_workload(path)
    assert sys.path == before


def test_a_probe_file_that_fails_leaves_no_module_behind(tmp_path, clean_imports):
    path = _file(tmp_path, "raise ZeroDivisionError('at import')\n")
    before = set(sys.modules)
    with pytest.raises(ProbeFileError, match="could not be imported: ZeroDivisionError: at import") as info:
        load_workload(path)
    assert set(sys.modules) - before == set() and isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("body,match", [
    ("raise ZeroDivisionError('at import')\n", "could not be imported: ZeroDivisionError: at import"),
    ("import no_such_dependency_of_it\n", "could not be imported: ModuleNotFoundError: No module named "
                                          "'no_such_dependency_of_it'"),
])
def test_a_probe_module_that_fails_to_import_says_why(tmp_path, monkeypatch, clean_imports, body, match):
    (tmp_path / "broken_probe_mod.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ProbeFileError, match=match):
        load_workload("broken_probe_mod")
