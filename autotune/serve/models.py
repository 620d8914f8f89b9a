"""A Hugging Face model by name in a plan request's body: a hub id and how it trains, never a path.

``{"target_batch": 64, "model": {"name": "Qwen/Qwen2.5-7B", "seq_len": 4096}, "device": "estimate:H100-80GB"}``
plans that model as ``autotune plan --model`` does: the worker fetches its ``config.json`` from the hub (or
the hub cache of the service's machine; ``HF_HUB_OFFLINE=1`` reads the cache alone) and builds the model
from it with no weights; code from the hub is never run. A request names a model on the hub only: no path
of the service's machine, and no file of sample lengths; a name without ``/`` that names a folder in one of
the operator's ``--models`` folders (``NAME/config.json``) is that folder's model, and its answer names it so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, create_model

from ..errors import BadInput
from ..results.model import ModelSpec
from ..results.settings import MODEL, Setting, settings_of
from .fields import body_field

#: A hub id as a request names one: owner/name (or a name alone), letters, digits, ``-``, ``_`` and ``.``.
HUB_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$"


class ModelSettings(BaseModel):
    """The model of a plan request: a hub id, and the settings of ``autotune plan --model``.

    Its settings are declared in :data:`autotune.results.settings.MODEL`, made into :class:`ModelBody` by
    :func:`model_body`."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(max_length=193, pattern=HUB_ID,
                               description="a Hugging Face hub id, e.g. Qwen/Qwen2.5-7B (only its config.json is "
                                           "read; weights never)")]
    if TYPE_CHECKING:  # the fields model_body declares
        task: str | None
        seq_len: int | None
        target_len: int | None
        num_labels: int | None
        optimizer: str
        lora: str | None
        gradient_checkpointing: bool
        dtype: str | None

    def spec(self) -> str:
        """The model's probe spec (``hf:NAME?...``), every setting checked by the library."""
        return ModelSpec(**self.model_dump()).spec()


def model_body(declared: tuple[Setting, ...] = MODEL) -> type[ModelSettings]:
    """The model of a plan request's body: a hub id and each model setting the service shows, as declared."""
    fields: dict[str, Any] = {s.name: body_field(s) for s in settings_of("model", "service", declared)}
    return create_model("ModelBody", __base__=ModelSettings, __module__=__name__, **fields)


if TYPE_CHECKING:
    ModelBody = ModelSettings
else:
    ModelBody = model_body()


class Body(Protocol):
    """A plan request's body, as far as what it plans goes (:class:`autotune.serve.bodies.PlanRequest`)."""

    @property
    def model(self) -> ModelBody | None: ...

    @property
    def probe(self) -> str: ...


def model_folders(folders: Sequence[str | Path]) -> tuple[Path, ...]:
    """``--models`` folders, checked: each must be a folder."""
    found = tuple(Path(f).resolve() for f in folders)
    for folder in found:
        if not folder.is_dir():
            raise BadInput(f"--models {folder} is not a folder: give folders holding model folders (NAME/config.json)")
    return found


def local_spec(model: ModelBody, folders: Sequence[Path]) -> str:
    """The spec a worker loads for ``model``: its folder ``NAME`` in the first of ``folders`` that holds
    ``NAME/config.json``, else the hub's (a name with ``/`` is always the hub's)."""
    if "/" not in model.name:
        for folder in folders:
            if (folder / model.name / "config.json").is_file():
                return ModelSpec(**{**model.model_dump(), "name": str(folder / model.name)}).spec()
    return model.spec()


def named(body: Body) -> str:
    """What a body plans: its model's probe spec, else its probe's name."""
    return body.model.spec() if body.model is not None else body.probe

