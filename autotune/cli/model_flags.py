"""``--model`` and its settings: a Hugging Face model by name as the workload of probe, plan and run."""

from __future__ import annotations

import argparse

from ..errors import BadInput
from ..results.settings import MODEL, flag_of
from .common import add_settings

#: The settings flags of ``--model``, as (flag, ModelSpec field), from their declarations.
SETTINGS = tuple((flag_of(s.name), s.name) for s in MODEL if "cli" in s.surfaces)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """``--model NAME`` (instead of ``--probe``) and how that model trains."""
    g = p.add_argument_group("a Hugging Face model by name (instead of --probe; weights are never downloaded)")
    g.add_argument("--model", metavar="NAME", default=None,
                   help="a hub id (only its config.json is fetched, into the Hugging Face cache; HF_HUB_OFFLINE=1 "
                        "reads the cache alone), a folder holding config.json, or a config.json file; the model is "
                        "built from the config with random weights (none at all on an estimate)")
    add_settings(g, "model", declared=MODEL)


def add_device(p: argparse.ArgumentParser) -> None:
    """The workload (--probe, or --model and its settings) and the device: its memory and margin."""
    add_settings(p, "probe", only=("probe",))
    add_model_flags(p)
    add_settings(p, "probe", only=("device", "memory_budget", "margin"))


def workload_of(args: argparse.Namespace) -> str | None:
    """The workload the flags name: ``--probe``'s spec, or ``--model``'s as a model spec (``hf:...``)."""
    model, probe = getattr(args, "model", None), getattr(args, "probe", None)
    given = [flag for flag, key in SETTINGS if getattr(args, key, None) is not None]
    if model is None:
        if given:
            raise BadInput(f"{', '.join(given)} {'is a setting' if len(given) == 1 else 'are settings'} of a model by "
                           "name: add --model NAME, or drop them")
        return probe
    if probe is not None:
        raise BadInput("--model and --probe each name the workload: give one of them")
    from ..results.model import ModelSpec, model_name

    settings = {key: getattr(args, key) for _, key in SETTINGS if getattr(args, key, None) is not None}
    if settings.get("lora") == "":
        settings["lora"] = "r=16"  # the defaults
    return ModelSpec(name=model_name(model), **settings).spec()
