"""``--model`` and its settings: a Hugging Face model by name as the workload of probe, plan and run."""

from __future__ import annotations

import argparse

from ..errors import BadInput
from ..results.model import DEFAULT_SEQ_LEN, OPTIMIZERS, PADDINGS, TASKS

#: The settings flags of ``--model``, as (flag, ModelSpec field).
SETTINGS = (("--task", "task"), ("--seq-len", "seq_len"), ("--target-len", "target_len"),
            ("--num-labels", "num_labels"), ("--optimizer", "optimizer"), ("--lora", "lora"),
            ("--gradient-checkpointing", "gradient_checkpointing"), ("--dtype", "dtype"), ("--lengths", "lengths"),
            ("--padding", "padding"))


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """``--model NAME`` (instead of ``--probe``) and how that model trains."""
    g = p.add_argument_group("a Hugging Face model by name (instead of --probe; weights are never downloaded)")
    g.add_argument("--model", metavar="NAME", default=None,
                   help="a hub id (only its config.json is fetched, into the Hugging Face cache; HF_HUB_OFFLINE=1 "
                        "reads the cache alone), a folder holding config.json, or a config.json file; the model is "
                        "built from the config with random weights (none at all on an estimate)")
    g.add_argument("--task", choices=TASKS, default=None, help="what the model is trained for (default: the one the "
                   "config's architectures name)")
    g.add_argument("--seq-len", metavar="N", default=None,
                   help=f"tokens in every sample (default: the config's maximum positions, at most {DEFAULT_SEQ_LEN})")
    g.add_argument("--target-len", metavar="N", default=None,
                   help="a seq2seq model's label tokens (default: --seq-len)")
    g.add_argument("--num-labels", metavar="N", default=None, help="a classifier's classes (default: the config's)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="adamw (torch's AdamW, Hugging Face Trainer's adamw_torch), sgd, adafactor; the 8-bit ones and "
                        "lion need bitsandbytes (default: adamw)")
    g.add_argument("--lora", metavar="SETTINGS", default=None, nargs="?", const="",
                   help="train LoRA adapters through peft, e.g. r=16,alpha=32,dropout=0.05,targets=all-linear "
                        "(those are the defaults; targets=q_proj+v_proj names modules; bits=4 is QLoRA: NF4 base "
                        "weights with double quantization, estimated by shape; bits=8 needs bitsandbytes)")
    g.add_argument("--gradient-checkpointing", action="store_true", default=None,
                   help="as Hugging Face's Trainer enables it (non-reentrant)")
    g.add_argument("--dtype", metavar="DTYPE", default=None,
                   help="the weights' dtype: fp32, bf16 or fp16 (Lightning's 32-true, bf16-true, 16-true too; "
                        "default: the config's, as transformers builds it; fp32 when it names none), or mixed "
                        "precision: bf16-mixed, 16-mixed (fp32 weights, the forward under autocast)")
    g.add_argument("--lengths", metavar="FILE", default=None,
                   help="samples of these lengths (a column of a CSV, Parquet or JSONL file, or the one named "
                        "length); --seq-len then truncates them (default: the longest)")
    g.add_argument("--padding", choices=PADDINGS, default=None,
                   help="with --lengths: pad a micro-batch to its longest sample (longest), or every sample to "
                        "--seq-len (max); packed is not supported yet (default: longest)")


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
