"""autotune/compat.py: every private PyTorch API the package uses goes through it, with its version checks."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

from autotune import compat

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"

#: A private name of torch's: a module or attribute after ``torch.`` (or ``nn.``) that begins with ``_`` (aten's
#: operators excepted: a dispatch mode sees them by name), an import from one, or a private attribute of one of
#: torch's objects that autotune reaches.
PRIVATE = re.compile(
    r"\b(?:torch|nn)(?:\.(?!ops\.aten\.)\w+)*\._(?!_)\w+"
    r"|\bfrom torch(?:\.\w+)*\._(?!_)\w+"
    r"|\.(?:_fsdp_param_groups?|_get_fsdp_state|_pg_registry|_dim_group_names|_destroy|_schema|_cdata|_op_impls"
    r"|_impls|_parameters|_buffers|_all_gather_result|_unsharded_param|_sequence_nr|_execution_engine"
    r"|_get_sequence_number_for_group|_register_backend|_set_group_name|_set_default_backend|_create_internal"
    r"|_propagate_tensor_meta_non_cached|_record_memory_history|_snapshot|py_kernels)\b"
    r"|\blibrary\.m\b")


def private_uses(source: str) -> list[str]:
    """``line: code`` of each use of a private torch API in Python ``source`` (strings and comments aside)."""
    kept: dict[int, list[str]] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.STRING, tokenize.COMMENT) and token.string.strip():
            kept.setdefault(token.start[0], []).append(token.string)
    found = []
    for line, parts in kept.items():
        code = re.sub(r"\s*\.\s*", ".", " ".join(parts))
        if PRIVATE.search(code):
            found.append(f"{line}: {code}")
    return found


def test_no_private_torch_api_outside_compat():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "compat.py":
            found += [f"{path.relative_to(PACKAGE.parent)}:{use}" for use in private_uses(path.read_text())]
    assert found == [], "reach these through autotune/compat.py"


@pytest.mark.parametrize(("source", "caught"), [
    ("import torch\nnode = torch._C._current_autograd_node()\n", True),
    ("from torch.utils._pytree import tree_map\n", True),
    ("from torch._subclasses.fake_tensor import FakeTensor\n", True),
    ("x = nn.modules.batchnorm._BatchNorm\n", True),
    ("groups = state._fsdp_param_groups\n", True),
    ("library._destroy()\n", True),
    ("import torch.distributed.tensor._sharding_prop\n", True),
    ("out = torch.ops.aten._to_copy.default\n", False),  # an operator's name
    ('"""What torch._C does."""\n# torch._C too\nx = "torch._C"\n', False),  # words, not code
    ("self._schema_cache = {}\nself._destroyed = True\n", False),
])
def test_the_check_catches_a_private_api(source, caught):
    assert bool(private_uses(source)) == caught


@pytest.mark.parametrize(("text", "want"), [("2.13.0+cpu", (2, 13)), ("2.11.0", (2, 11)), ("2.14.1+cu128", (2, 14)),
                                            ("2.12.0a0+git1234", (2, 12))])
def test_the_torch_version_compat_reads(text, want):
    assert compat.version(text) == want


def test_the_installed_torch_is_one_the_project_supports():
    assert compat.TORCH == compat.version(torch.__version__) and compat.TORCH >= (2, 11)


def test_fsdp_parameter_groups_by_version(monkeypatch):
    """torch 2.12 gave every FSDP module a list of parameter groups; before, at most one."""
    from types import SimpleNamespace

    group = object()
    module = SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(_fsdp_param_groups=[group, group],
                                                                      _fsdp_param_group=group))
    monkeypatch.setattr(compat, "TORCH", (2, 12))
    assert compat.fsdp_param_groups(module) == (group, group)
    monkeypatch.setattr(compat, "TORCH", (2, 11))
    assert compat.fsdp_param_groups(module) == (group,)
    none = SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(_fsdp_param_group=None))
    assert compat.fsdp_param_groups(none) == ()
