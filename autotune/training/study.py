"""Where a tuning study lives: optuna storage URLs checked before any work, study names that
carry a digest of everything that shapes the candidates, and studies refused when they were
made for other settings. No torch here: the CLI checks a storage before torch loads.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BadInput

if TYPE_CHECKING:
    from ..devices.base import Device
    from ..planning.planner import Uniform
    from ..workload import Workload

SETTINGS = "autotune_settings"  # the study's user attribute that records what it was made for


def check_storage(url: str | None, name: str = "storage") -> None:
    """BadInput (one line, naming ``name``) unless ``url`` is a database URL optuna can use here:
    a dialect SQLAlchemy knows, its driver installed, an SQLite file's folder present. Connects to nothing."""
    if url is None:
        return
    if not isinstance(url, str) or not url.strip():
        raise BadInput(f"{name} {url!r} must be a database URL such as sqlite:///tune.db")
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise BadInput(f"{name} {url!r} is not a database URL: use e.g. sqlite:///{url}") from None
    shown = shown_url(url)
    try:
        create_engine(parsed).dispose()
    except NoSuchModuleError:
        raise BadInput(f"{name} {shown!r} names no database driver SQLAlchemy knows ({parsed.drivername}): "
                       "use e.g. sqlite:///tune.db, postgresql://HOST/DB or mysql://HOST/DB") from None
    except ImportError as exc:
        raise BadInput(f"{name} {shown!r} needs the Python driver {exc.name or exc}, which is not installed: "
                       "install it, or use sqlite:///FILE") from None
    except (SQLAlchemyError, ValueError, TypeError) as exc:  # any other refusal of the URL
        raise BadInput(f"{name} {shown!r} cannot be used: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    database = parsed.database or ""
    if parsed.get_backend_name() == "sqlite" and database not in ("", ":memory:") and not database.startswith("file:"):
        path = Path(database)
        if not path.parent.is_dir():
            raise BadInput(f"{name} {shown!r}: folder {path.parent} does not exist; create it or choose another path")
        if path.is_dir():
            raise BadInput(f"{name} {shown!r}: {path} is a folder, not a database file; name a file in it")


def shown_url(url: str | None) -> str | None:
    """``url`` as it may be printed and saved: any password replaced by ***."""
    if url is None:
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return url


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
        raise BadInput(f"storage {shown_url(storage)!r} cannot be opened: {first}") from None
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
