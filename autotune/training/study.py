"""Where a tuning study lives: study names that carry a digest of everything that shapes the
candidates, and studies refused when they were made for other settings. Storage URLs are
checked before any work by :func:`autotune.dburl.check_storage` (no torch there).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from ..dburl import check_storage, shown_url
from ..errors import BadInput

if TYPE_CHECKING:
    from ..devices.base import Device
    from ..planning.planner import Uniform
    from ..workload import Workload

__all__ = ["check_storage", "default_study_name", "open_study", "shown_url", "study_settings"]

SETTINGS = "autotune_settings"  # the study's user attribute that records what it was made for


def study_settings(workload: Workload, device: Device, target_batch: int, *, world_size: int, multiple_of: int,
                   uniform: Uniform, margin: float, sizes: dict[str, list[int]]) -> dict[str, Any]:
    """Everything that shapes a study's candidates and timings, as JSON-ready values."""
    desc = device.describe()
    settings = {"workload": workload.name, "target_batch": target_batch, "world_size": world_size,
                "multiple_of": multiple_of, "uniform": uniform, "margin": margin, "device": desc.name,
                "device_model": desc.model, "memory_budget": desc.budget_bytes, "candidates": sizes}
    return json.loads(json.dumps(settings))


def default_study_name(settings: dict[str, Any]) -> str:
    """``autotune-<workload>-<target>-<digest of the settings>``."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:10]
    return f"autotune-{settings['workload']}-{settings['target_batch']}-{digest}"


def open_study(optuna: Any, storage: str | None, name: str, settings: dict[str, Any], seed: int) -> Any:
    """The study ``name``, made or resumed; BadInput when it was made for other settings."""
    from sqlalchemy.exc import SQLAlchemyError

    sampler = optuna.samplers.BruteForceSampler(seed=seed)
    try:
        study = optuna.create_study(direction="maximize", sampler=sampler, storage=storage, study_name=name,
                                    load_if_exists=True)
    except SQLAlchemyError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadInput(f"cannot be opened: {first}", field="storage", value=shown_url(storage)) from None
    recorded = study.user_attrs.get(SETTINGS)
    if recorded is None and not _space_matches(study, settings["candidates"]):
        recorded = {}
    if recorded is not None and recorded != settings:
        differ = [k for k in sorted(settings) if recorded.get(k) != settings[k]]
        what = ", ".join("other candidate micro-batches" if k == "candidates" else
                         f"{k} {recorded[k]!r}, not {settings[k]!r}" if k in recorded else k for k in differ)
        raise BadInput(f"study {name!r} in {shown_url(storage) or 'memory'} was made for other settings ({what}): "
                       "give another study name, or none for one named after these settings")
    if recorded is None:
        study.set_user_attr(SETTINGS, settings)
    return study


def _space_matches(study: Any, sizes: dict[str, list[int]]) -> bool:
    """Every parameter the study's trials used has exactly this space's choices."""
    want = {"options": tuple(sorted(sizes))} | {f"micro_batch[{label}]": tuple(s) for label, s in sizes.items()}
    return all(name in want and tuple(getattr(dist, "choices", ())) == want[name]
               for trial in study.get_trials(deepcopy=False) for name, dist in trial.distributions.items())
