"""A declared setting (:mod:`autotune.results.settings`) as a field of a request body: its JSON type, bounds,
default and description, as pydantic's ``create_model`` takes them.

A body module passes what it says beyond a declaration (``extra``: a strict annotation where the type alone is
not one, a pattern, its own description); every bound and default comes from the declaration, or from its
``body`` where the service differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt

from ..results.settings import Setting

_FIELD_KEYWORDS = ("max_length", "pattern")
_JSON_TYPES: dict[Any, Any] = {bool: StrictBool, int: StrictInt, float: float, str: str}


def _annotation(declared: Setting, over: Mapping[str, Any], default: Any) -> Any:
    """The JSON type of a setting's values in a body."""
    if "annotation" in over:
        return over["annotation"]
    choices = over.get("choices", declared.choices)
    kind: Any = Literal[choices] if choices else _JSON_TYPES.get(declared.type, Any)
    return kind | None if default is None and not declared.required else kind


def body_field(declared: Setting, extra: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
    """A setting as ``create_model`` takes a field: (its annotated type, its default)."""
    over = {**declared.body, **(extra or {})}
    default = over.get("default", declared.default)
    bounds = {"ge": over.get("least", declared.least), "le": over.get("most", declared.most),
              "lt": over.get("below", declared.below)}
    keywords = {k: v for k, v in bounds.items() if v is not None}
    keywords.update({k: over[k] for k in _FIELD_KEYWORDS if k in over})
    described = Field(description=over.get("description", declared.help), **keywords)
    annotation = Annotated[_annotation(declared, over, default), described]  # type: ignore[valid-type]
    return (annotation, ...) if declared.required else (annotation, default)
