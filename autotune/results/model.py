"""A Hugging Face model by name as a workload spec, and what a probe says about such a model.

``autotune plan --model Qwen/Qwen2.5-7B --seq-len 4096`` names a model by its config (a hub id, a folder
holding ``config.json``, or a ``config.json`` file) and how it is trained (task, batch shape, optimizer,
LoRA, gradient checkpointing, the weights' dtype). :class:`ModelSpec` holds those settings and writes them
as one probe spec string, ``hf:NAME?key=value&...`` (keys sorted, only what differs from the defaults),
so a request, its fingerprint, the plan store and the service carry a model by name exactly as they carry
a probe file. :class:`ModelFacts` is what a probe result says about the model: its parameter counts as
transformers and peft count them, and what the usual formula (weights, and Adam training as 4x the
weights) would have said.

No torch here: requests are built before torch loads.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, urlencode

from .. import options
from ..errors import BadInput
from .record import Record

#: The prefix of a model-by-name probe spec.
PREFIX = "hf:"
#: Tasks a model by name is trained for (from the config's ``architectures``, or ``--task``).
TASKS = ("causal-lm", "seq2seq-lm", "masked-lm", "sequence-classification", "image-classification")
#: Optimizers by the names people give them; the 8-bit ones and lion need bitsandbytes.
OPTIMIZERS = ("adamw", "sgd", "adafactor", "adamw-8bit", "paged-adamw-8bit", "lion", "lion-8bit")
NEEDS_BITSANDBYTES = ("adamw-8bit", "paged-adamw-8bit", "lion", "lion-8bit")
#: How samples of different lengths (``--lengths``) make a micro-batch.
PADDINGS = ("longest", "max", "packed")
#: The weights' dtype, by the project's names and Lightning's "-true" ones; Lightning's "-mixed" ones are
#: mixed precision: fp32 weights, the forward and loss under autocast to bf16 (or fp16, with a GradScaler).
DTYPES = {"fp32": "fp32", "32": "fp32", "32-true": "fp32", "float32": "fp32",
          "bf16": "bf16", "bf16-true": "bf16", "bfloat16": "bf16",
          "fp16": "fp16", "16": "fp16", "16-true": "fp16", "float16": "fp16",
          "bf16-mixed": "bf16-mixed", "16-mixed": "fp16-mixed", "fp16-mixed": "fp16-mixed"}
#: LoRA's settings as ``--lora`` names them, with peft's defaults where a user names none.
LORA_KEYS = {"r": 16, "alpha": 32, "dropout": 0.05, "targets": "all-linear", "bits": 16}
#: Longest sequence a model by name trains on when ``--seq-len`` is not given (nor a shorter maximum).
DEFAULT_SEQ_LEN = 2048
W = TypeVar("W")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_model_spec(spec: object) -> bool:
    """Whether ``spec`` is a model-by-name probe spec (``hf:...``)."""
    return isinstance(spec, str) and spec.strip().startswith(PREFIX)


def dtype_name(value: object, name: str = "dtype") -> str:
    """``fp32``, ``bf16``, ``fp16``, ``bf16-mixed`` or ``fp16-mixed`` for any of their names (Lightning's
    ``bf16-true``, ``16-mixed`` too)."""
    text = str(value).strip().lower()
    if text in DTYPES:
        return DTYPES[text]
    raise BadInput(f"{name} {value!r} is not one of fp32, bf16, fp16, bf16-mixed, fp16-mixed (or Lightning's "
                   "32-true, bf16-true, 16-true, 16-mixed)")


def lora_settings(value: object, name: str = "lora") -> str:
    """``--lora``'s ``r=16,alpha=32,dropout=0.05,targets=all-linear`` checked and written in full
    (``targets`` may list modules with ``+``: ``targets=q_proj+v_proj``; ``bits=4`` or ``8`` is QLoRA, the
    frozen weights quantized, written only then)."""
    given: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in str(value).split(","))):
        key, eq, text = part.partition("=")
        if not eq or key.strip() not in LORA_KEYS:
            raise BadInput(f"{name} {value!r}: {part!r} is not one of {', '.join(k + '=' for k in LORA_KEYS)} "
                           "(e.g. r=16,alpha=32,dropout=0.05,targets=all-linear)")
        given[key.strip()] = text.strip()
    settings: dict[str, Any] = dict(LORA_KEYS)
    try:
        for key, text in given.items():
            settings[key] = int(text) if key in ("r", "alpha", "bits") else float(text) if key == "dropout" else text
    except ValueError:
        raise BadInput(f"{name} {value!r}: r and alpha are whole numbers, dropout a fraction") from None
    if settings["r"] < 1 or settings["alpha"] < 1 or not 0 <= settings["dropout"] < 1 or not settings["targets"]:
        raise BadInput(f"{name} {value!r}: r and alpha must be at least 1, dropout in [0, 1), targets named")
    if settings["bits"] not in (4, 8, 16):
        raise BadInput(f"{name} {value!r}: bits is 4 or 8 (QLoRA), or 16 (plain LoRA)")
    return ",".join(f"{k}={settings[k]}" for k in LORA_KEYS if k != "bits" or settings[k] != 16)


def display_name(name: str) -> str:
    """A model's name in results: a hub id as it is, a local model by its folder's name (no path)."""
    path = Path(name)
    if not path.is_absolute():
        return name
    return (path.parent if path.suffix == ".json" else path).name or name


def model_name(name: object) -> str:
    """A model as a user names it, as a spec names it: a folder or ``config.json`` that exists here as its
    absolute path, anything else as given (a hub id)."""
    text = options.text(name, "model")
    path = Path(text).expanduser()
    return str(path.resolve()) if path.exists() else text


def checked_name(name: object) -> str:
    """A spec's model: an absolute path is a folder holding ``config.json`` or that file, any other name a
    hub id (never a path: a spec that travels, to a service's worker say, reads nothing but the hub)."""
    text = options.text(name, "model")
    if Path(text).is_absolute():
        path = Path(text)
        if path.is_dir() and not (path / "config.json").is_file():
            raise BadInput(f"model folder {text!r} holds no config.json: give the folder of a Hugging Face model "
                           "(its config.json is enough), a config.json file, or a hub id such as Qwen/Qwen2.5-7B")
        if path.exists():
            return text
    elif _HUB_ID.match(text) and not text.endswith(".json"):
        return text
    raise BadInput(f"model {text!r} is neither an existing folder or config.json nor a hub id "
                   "(owner/name, e.g. Qwen/Qwen2.5-7B)")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A Hugging Face model by name and how it trains; every setting checked when made.

    ``name``: a hub id (only its ``config.json`` is fetched), or the absolute path of a folder holding
    ``config.json`` or of that file (:func:`model_name` makes one of a path as a user gives it).
    ``task``: None for the one the config's ``architectures`` names. ``seq_len``: tokens per sample
    (None: the config's maximum positions, at most :data:`DEFAULT_SEQ_LEN`); ``target_len``: a seq2seq
    model's label tokens (None: ``seq_len``); ``num_labels``: a classifier's classes (None: the config's).
    ``dtype``: the weights' (None: the config's, as transformers builds it; fp32 when it names none), or mixed
    precision, ``bf16-mixed``/``fp16-mixed``: fp32 weights, gradients and optimizer state, the forward and the
    loss under autocast on the model's device (CUDA's on an estimate standing in for a GPU); under LoRA the
    frozen weights stay in the config's dtype (fp32 adapters), as Hugging Face's Trainer with ``bf16=True``
    trains a model loaded as transformers loads it.
    ``lengths``: a file with a column of sample lengths (CSV, Parquet, JSONL), padded as ``padding`` says:
    ``longest`` to the longest sample of a micro-batch, ``max`` to ``seq_len``, or ``packed``: a causal LM's
    samples concatenated into one row, as Hugging Face's ``DataCollatorWithFlattening`` makes it (position ids
    restart at each sample, so attention stays inside it); with ``lengths``, ``seq_len`` is where samples are
    truncated (default: the longest sample).
    """

    name: str
    task: str | None = None
    seq_len: int | None = None
    target_len: int | None = None
    num_labels: int | None = None
    optimizer: str = "adamw"
    lora: str | None = None
    gradient_checkpointing: bool = False
    dtype: str | None = None
    lengths: str | None = None
    padding: str = "longest"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "name", checked_name(self.name))
        if self.task is not None:
            set_(self, "task", options.choice(self.task, TASKS, "task"))
        for key in ("seq_len", "target_len", "num_labels"):
            if getattr(self, key) is not None:
                set_(self, key, options.whole(getattr(self, key), key))
        set_(self, "optimizer", options.choice(self.optimizer, OPTIMIZERS, "optimizer"))
        if self.lora is not None:
            set_(self, "lora", lora_settings(self.lora))
        set_(self, "gradient_checkpointing", _flag(self.gradient_checkpointing))
        if self.dtype is not None:
            set_(self, "dtype", dtype_name(self.dtype))
        set_(self, "padding", options.choice(self.padding, PADDINGS, "padding"))
        if self.lengths is not None:
            path = Path(str(self.lengths)).expanduser()
            if not path.is_file():
                raise BadInput(f"lengths file {self.lengths!r} does not exist: give a CSV, Parquet or JSONL file "
                               "with a column of sample lengths")
            set_(self, "lengths", str(path.resolve()))

    def described(self, seq_len: int | None = None) -> str:
        """Every training setting in words (the defaults too), ``seq_len`` the tokens a sample it resolved to."""
        weights = "frozen weights in the config's dtype, fp32 adapters" if self.lora else "fp32 weights"
        dtype = {"bf16-mixed": f"bf16-mixed ({weights}, autocast to bf16)",
                 "fp16-mixed": f"fp16-mixed ({weights}, autocast to fp16, a GradScaler)"}.get(
            self.dtype or "", f"weights in {self.dtype}" if self.dtype else "weights in the config's dtype")
        bits = self.lora.rpartition("bits=")[2] if self.lora and "bits=" in self.lora else None
        lora = "full fine-tuning" if self.lora is None else \
            (f"QLoRA {self.lora} (NF4 base weights by shape)" if bits == "4" else f"LoRA {self.lora}")
        parts = [f"seq_len {seq_len or self.seq_len}" if (seq_len or self.seq_len) else None,
                 f"target_len {self.target_len}" if self.target_len else None,
                 f"num_labels {self.num_labels}" if self.num_labels else None,
                 lora, dtype, f"optimizer {self.optimizer}",
                 "gradient checkpointing" if self.gradient_checkpointing else "no gradient checkpointing",
                 f"lengths from {Path(self.lengths).name} padded to the {self.padding}" if self.lengths else None]
        return ", ".join(p for p in parts if p)

    def spec(self) -> str:
        """The probe spec string: ``hf:NAME`` and ``?key=value&...`` for what differs from the defaults."""
        defaults = ModelSpec.__dataclass_fields__
        given = {k: v for k, v in asdict(self).items() if k != "name" and v != defaults[k].default}
        query = urlencode(sorted((k, _text(v)) for k, v in given.items()))
        return PREFIX + quote(self.name, safe="/:.-_~") + (f"?{query}" if query else "")

    @classmethod
    def parse(cls, spec: str) -> ModelSpec:
        """The settings a ``hf:NAME?key=value&...`` spec names, checked."""
        body = spec.strip().removeprefix(PREFIX)
        name, _, query = body.partition("?")
        known = {f.name for f in fields(cls)} - {"name"}
        pairs: dict[str, Any] = dict(parse_qsl(query, keep_blank_values=True))
        unknown = sorted(set(pairs) - known)
        if unknown:
            raise BadInput(f"model spec {spec!r}: {', '.join(unknown)} is not a setting ({', '.join(sorted(known))})")
        from urllib.parse import unquote

        return cls(name=unquote(name), **pairs)


#: Hugging Face Trainer's ``optim`` for each optimizer.
TRAINER_OPTIM = {"adamw": "adamw_torch", "sgd": "sgd", "adafactor": "adafactor", "adamw-8bit": "adamw_bnb_8bit",
                 "paged-adamw-8bit": "paged_adamw_8bit", "lion": "lion_32bit", "lion-8bit": "lion_8bit"}
_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def trainer_settings(spec: str, micro_batch: int, steps: int) -> dict[str, Any]:
    """The Hugging Face settings that train the model of ``spec`` (a model spec, ``hf:...``) as it was
    planned: ``training_arguments`` (``TrainingArguments(output_dir=..., **them)``), ``from_pretrained``
    (the weights' dtype, QLoRA's ``quantization_config`` as ``BitsAndBytesConfig`` keywords) and, under LoRA,
    ``lora_config`` (``peft.LoraConfig(**it)``). Read from the spec's text alone (no file is opened)."""
    given = dict(parse_qsl(spec.strip().removeprefix(PREFIX).partition("?")[2]))
    dtype, lora = given.get("dtype"), given.get("lora")
    arguments: dict[str, Any] = {"per_device_train_batch_size": micro_batch, "gradient_accumulation_steps": steps,
                                 "optim": TRAINER_OPTIM[given.get("optimizer", "adamw")], "learning_rate": 5e-5,
                                 "weight_decay": 0.0}
    if dtype in ("bf16-mixed", "fp16-mixed"):
        arguments[dtype[:4]] = True
    if given.get("gradient_checkpointing") == "true":
        arguments.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    loading: dict[str, Any] = {"dtype": "float32" if dtype in ("bf16-mixed", "fp16-mixed") and lora is None
                               else _TORCH_DTYPES.get(dtype or "", "auto")}
    out: dict[str, Any] = {"training_arguments": arguments, "from_pretrained": loading}
    if lora is not None:
        keys = dict(part.split("=", 1) for part in lora.split(","))
        targets = keys["targets"] if keys["targets"] == "all-linear" else keys["targets"].split("+")
        out["lora_config"] = {"r": int(keys["r"]), "lora_alpha": int(keys["alpha"]),
                              "lora_dropout": float(keys["dropout"]), "target_modules": targets}
        if keys.get("bits") == "4":
            compute = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}.get(dtype or "", loading["dtype"])
            loading["quantization_config"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                              "bnb_4bit_use_double_quant": True,
                                              "bnb_4bit_compute_dtype": "float32" if compute == "auto" else compute}
    return out


def run_precision(spec: str | None, precision: str) -> str:
    """The precision a run trains the workload ``spec`` in: a model by name in mixed precision (``bf16-mixed``)
    runs as ``run(precision="bf16")`` does (its tolerance, fp16's GradScaler), whatever ``precision`` left at
    fp32; BadInput when ``precision`` names another."""
    if spec is None or not is_model_spec(spec):
        return precision
    dtype = dict(parse_qsl(spec.strip().removeprefix(PREFIX).partition("?")[2])).get("dtype", "")
    wanted = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(dtype)
    if wanted is None or precision in (wanted, "fp32"):
        return wanted or precision
    raise BadInput(f"precision {precision} is not the model's dtype {dtype}: give precision {wanted} (or leave it "
                   f"out), or the model's dtype {precision}-mixed")


def _flag(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes"):
        return True
    if str(value).lower() in ("0", "false", "no"):
        return False
    raise BadInput(f"gradient_checkpointing {value!r} must be true or false")


def _text(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


@dataclass(frozen=True, kw_only=True)
class ModelFacts(Record):
    """What a probe says about a model by name: its class and task, parameters as transformers counts them
    (``model.num_parameters()``) and as trainable (peft's count under LoRA), the sample shape, and the
    formula's figures (``accelerate estimate-memory``): the weights at their dtype, and Adam training as
    4x the weights, with no activations, batch or allocator. ``dtype``: the one most parameters are in."""

    name: str
    architecture: str
    task: str
    total_parameters: int
    trainable_parameters: int
    dtype: str
    seq_len: int | None = None
    lora: str | None = None
    formula_weights_bytes: int = 0
    formula_adam_training_bytes: int = 0
    config_source: str | None = None  # where its config.json was read: the hub's (a revision) or a local file
    settings: str | None = None  # how it trains, every setting (ModelSpec.described)

    def report_line(self) -> str:
        """The model, where its config came from and how it trains, for a report's summary."""
        share = f", {self.trainable_parameters:,} trainable" if self.trainable_parameters != self.total_parameters \
            else ""
        source = f"; config from {self.config_source}" if self.config_source else ""
        trains = f"; {self.settings}" if self.settings else ""
        return (f"{display_name(self.name)} ({self.architecture}, {self.task}): {self.total_parameters:,} "
                f"parameters{share}, "
                f"weights mostly {self.dtype}{source}{trains}")

    def line(self) -> str:
        """One line for people: the counts, and what the formula would have said."""
        from ..units import format_bytes

        share = f" ({self.trainable_parameters:,} trainable)" if self.trainable_parameters != self.total_parameters \
            else ""
        shape = f", {self.seq_len} tokens a sample" if self.seq_len else ""
        return (f"model: {self.name} ({self.architecture}, {self.task}{shape}): {self.total_parameters:,} parameters"
                f"{share}; accelerate estimate-memory's formula: weights {format_bytes(self.formula_weights_bytes)} "
                f"in {self.dtype}, Adam training ~{format_bytes(self.formula_adam_training_bytes)} (4x the weights; "
                "no activations, batch, gradient buckets or allocator)")


def workload_or_model(workload: W, model: object) -> W | str:
    """The API's ``workload`` and ``model`` as one workload: ``model`` (a name, or a :class:`ModelSpec`) as its
    probe spec; both given is BadInput."""
    if model is None:
        return workload
    if workload is not None:
        raise BadInput("workload and model each name what to plan for: give one of them")
    if isinstance(model, ModelSpec):
        return replace(model, name=model_name(model.name)).spec()
    if is_model_spec(model):
        return ModelSpec.parse(str(model)).spec()
    return ModelSpec(name=model_name(model)).spec()


def named_as(facts: ModelFacts, spec: str | None) -> ModelFacts:
    """``facts`` under the model name of the request's ``spec`` (a service's request names an operator's
    folder by its name alone)."""
    return replace(facts, name=ModelSpec.parse(spec).name) if spec is not None and is_model_spec(spec) else facts
