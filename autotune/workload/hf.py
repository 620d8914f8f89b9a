"""The Workload of a Hugging Face model by name: built from its config, weights never downloaded.

    autotune plan --model Qwen/Qwen2.5-7B --seq-len 4096 --device estimate:H100-80GB --target-batch 64

The config comes from a folder, a ``config.json`` file, or the hub (only ``config.json``, fetched with
``huggingface_hub.hf_hub_download`` into its usual cache; ``HF_HUB_OFFLINE=1`` reads the cache alone).
The model is ``AutoModelFor<task>.from_config(config)``: on the estimate's shape-only device it holds no
memory, on a real one random weights of the real size. Batches are what Hugging Face's collators make:
a causal LM's labels are its input ids, a seq2seq model's are ``target_len`` tokens, a masked LM's are
the masked 15% of tokens, a classifier's one class a sample; the loss is the model's own
(``model(**batch).loss``). Code from the hub (``trust_remote_code``) is never run.
"""

from __future__ import annotations

import copy
import functools
import json
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BadInput
from ..results.model import DEFAULT_SEQ_LEN, NEEDS_BITSANDBYTES, ModelFacts, ModelSpec, display_name
from . import packing
from .core import Workload
from .from_model import _loss_from_output

#: Each task's auto class and the transformers mapping of the architectures it builds, in the order a
#: config's ``model_type`` is looked up when its ``architectures`` name none of them.
AUTO = {
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "seq2seq-lm": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "sequence-classification": ("AutoModelForSequenceClassification",
                                "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "image-classification": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "bf16-mixed": torch.float32, "fp16-mixed": torch.float32}  # mixed: fp32 weights, autocast's dtype below
AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
#: Share of tokens a masked LM's collator masks (``DataCollatorForLanguageModeling``'s mlm_probability).
MLM_PROBABILITY = 0.15
LEARNING_RATE = 5e-5  # Hugging Face Trainer's default


def config_file(name: str) -> Path:
    """The ``config.json`` a model spec names: the file, the folder's, or the hub's (cached)."""
    path = Path(name)
    if path.is_absolute():  # a spec's local model (any other name is a hub id)
        return path / "config.json" if path.is_dir() else path
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(hf_hub_download(name, "config.json"))
    except GatedRepoError:
        raise BadInput(f"model {name!r} is gated on the Hugging Face hub: accept its terms on huggingface.co and log "
                       "in (hf auth login, or HF_TOKEN), or give a folder holding its config.json") from None
    except RepositoryNotFoundError:
        raise BadInput(f"model {name!r} is not on the Hugging Face hub (or is private: log in with hf auth login): "
                       "check the id, or give a folder holding its config.json") from None
    except LocalEntryNotFoundError:  # an EntryNotFoundError too: first
        raise BadInput(f"the config.json of {name!r} is not in the Hugging Face cache and the hub cannot be reached "
                       "(HF_HUB_OFFLINE, or no network): fetch it once online, or give a folder holding its "
                       "config.json") from None
    except EntryNotFoundError:
        raise BadInput(f"model {name!r} on the Hugging Face hub has no config.json: give a folder holding one") \
            from None


def load_config(name: str) -> Any:
    """The transformers config of ``name``; BadInput for one that needs code from the hub."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    path = config_file(name)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"config {str(path)!r} of model {name!r} cannot be read as JSON: {exc}") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if not isinstance(data, dict) or "auto_map" in data or model_type not in CONFIG_MAPPING_NAMES:
        what = "names code of its own (auto_map)" if isinstance(data, dict) and "auto_map" in data else \
            f"has model_type {model_type!r}, which transformers {transformers.__version__} does not know"
        raise BadInput(f"model {name!r} {what}: autotune never runs code from the hub (trust_remote_code); write a "
                       "probe file that builds it (autotune plan --probe my_model.py; see Workload.from_model)")
    data = {k: v for k, v in data.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(str(model_type), **data)


def task_of(config: Any, task: str | None) -> str:
    """The task ``task`` names, else the one the config's ``architectures`` (or its model type) is built for."""
    from transformers.models.auto import modeling_auto

    if task is not None:
        return task
    mappings = {t: getattr(modeling_auto, names) for t, (_, names) in AUTO.items()}
    for arch in getattr(config, "architectures", None) or ():
        for t, mapping in mappings.items():
            if arch in mapping.values():
                return t
    for t, mapping in mappings.items():
        if config.model_type in mapping:
            return t
    raise BadInput(f"the config of {config.model_type!r} (architectures {getattr(config, 'architectures', None)}) "
                   f"names no task autotune builds: give --task ({', '.join(AUTO)})")


@dataclass(frozen=True)
class Shape:
    """A sample's shape: tokens (and label tokens) for text, channels and size for images."""

    seq_len: int | None = None
    target_len: int | None = None
    image: tuple[int, int, int] | None = None
    vocab: int = 0
    num_labels: int = 0
    lengths: tuple[int, ...] = ()
    padding: str = "longest"


def _max_positions(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def shape_of(spec: ModelSpec, config: Any, task: str) -> Shape:
    """The sample shape ``spec`` asks for, its defaults from the config."""
    num_labels = spec.num_labels or int(getattr(config, "num_labels", 2))
    if task == "image-classification":
        size = getattr(config, "image_size", 224)
        size = size if isinstance(size, int) else int(max(size))
        return Shape(image=(int(getattr(config, "num_channels", 3)), size, size), num_labels=num_labels)
    most = _max_positions(config)
    lengths = read_lengths(spec.lengths) if spec.lengths else ()
    seq_len = spec.seq_len or (max(lengths) if lengths else min(most or DEFAULT_SEQ_LEN, DEFAULT_SEQ_LEN))
    if most is not None and seq_len > most and task != "seq2seq-lm":
        raise BadInput(f"seq_len {seq_len} is past the {most} positions the config of {spec.name!r} allows: give "
                       f"--seq-len {most} or less" + (" (longer samples are truncated)" if lengths else ""))
    return Shape(seq_len=seq_len, target_len=spec.target_len or seq_len, vocab=int(config.vocab_size),
                 num_labels=num_labels, lengths=tuple(min(n, seq_len) for n in lengths), padding=spec.padding)


def read_lengths(path: str) -> tuple[int, ...]:
    """The sample lengths in ``path``: the one numeric column (or the one named ``length``) of a CSV, Parquet
    or JSONL file, read with pandas."""
    import pandas as pd

    readers: dict[str, Callable[[str], Any]] = {".parquet": pd.read_parquet, ".jsonl": functools.partial(
        pd.read_json, lines=True), ".json": functools.partial(pd.read_json, lines=True), ".csv": pd.read_csv}
    read = readers.get(Path(path).suffix.lower())
    if read is None:
        raise BadInput(f"lengths file {path!r}: give a .csv, .parquet or .jsonl file")
    frame = read(path)
    numeric = [c for c in frame.columns if pd.api.types.is_integer_dtype(frame[c])]
    column = "length" if "length" in frame.columns else numeric[0] if len(numeric) == 1 else None
    if column is None or frame[column].empty or (frame[column] < 1).any():
        raise BadInput(f"lengths file {path!r}: needs one column of whole lengths of at least 1 (or one named "
                       f"'length'); found columns {list(frame.columns)}")
    return tuple(int(v) for v in frame[column])


def make_batch(n: int, generator: torch.Generator, *, task: str, shape: Shape) -> dict[str, torch.Tensor]:
    """``n`` samples as Hugging Face's collators make them, with random token ids (or pixels): the worst case
    of ``--lengths`` (its ``n`` longest samples) where given."""
    if shape.image is not None:
        return {"pixel_values": torch.randn((n, *shape.image), generator=generator),
                "labels": torch.randint(shape.num_labels, (n,), generator=generator)}
    assert shape.seq_len is not None
    return of_lengths(_sample_lengths(n, shape) if shape.lengths else [shape.seq_len] * n, generator, task=task,
                      shape=shape)


def of_lengths(lengths: Sequence[int], generator: torch.Generator, *, task: str, shape: Shape) -> dict[str, Any]:
    """One sample of each of ``lengths`` tokens (truncated at ``seq_len``), padded or packed as ``shape`` says."""
    assert shape.seq_len is not None and shape.target_len is not None
    real = [min(int(k), shape.seq_len) for k in lengths]
    if shape.padding == "packed":
        return packing.packed_batch(real, generator, shape.vocab)
    n, width = len(real), shape.seq_len if shape.padding == "max" else max(real)
    ids = torch.randint(shape.vocab, (n, width), generator=generator)
    mask = (torch.arange(width) < torch.tensor(real).unsqueeze(1)).long()
    batch = {"input_ids": ids, "attention_mask": mask}
    if task == "causal-lm":
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    elif task == "seq2seq-lm":
        batch["labels"] = torch.randint(shape.vocab, (n, shape.target_len), generator=generator)
    elif task == "masked-lm":
        masked = (torch.rand(n, width, generator=generator) < MLM_PROBABILITY) & (mask == 1)
        masked[:, 0] = True  # every sample holds at least one label
        batch["labels"] = ids.masked_fill(~masked, -100)
    else:
        batch["labels"] = torch.randint(shape.num_labels, (n,), generator=generator)
    return batch


def _sample_lengths(n: int, shape: Shape) -> list[int]:
    """The worst case of ``n`` samples from ``--lengths``: the ``n`` longest (cycled when there are fewer)."""
    ordered = sorted(shape.lengths, reverse=True)
    return [ordered[i % len(ordered)] for i in range(n)]


def split_padded(batch: dict[str, Any], sizes: list[int], *, task: str) -> list[dict[str, Any]]:
    """Consecutive samples of a batch padded to its longest, ``sizes`` of them in each part, each part padded
    to its own longest (as a collator pads each micro-batch): the padding past it dropped."""
    out, first = [], 0
    for n in sizes:
        rows = {k: v[first:first + n] for k, v in batch.items()}
        width = int(rows["attention_mask"].sum(1).max())
        cols = ["input_ids", "attention_mask"] + (["labels"] if task in ("causal-lm", "masked-lm") else [])
        out.append({k: v[:, :width] if k in cols else v for k, v in rows.items()})
        first += n
    return out


def text_tokens(batch: dict[str, Any]) -> int:
    """A padded batch's tokens: those its attention mask keeps."""
    return int(batch["attention_mask"].sum())


def needs_bitsandbytes(what: str, instead: str) -> BadInput:
    """Why ``what`` cannot be planned: it needs bitsandbytes (not installed, or not estimable)."""
    import importlib.util

    missing = importlib.util.find_spec("bitsandbytes") is None
    return BadInput(f"{what} needs bitsandbytes" + (" (pip install bitsandbytes), which is not installed" if missing
                    else ", whose kernels the estimate cannot stand in for") + f": {instead}, or write a probe file")


def autocast_loss(loss: Callable[[nn.Module, Any], torch.Tensor], dtype: torch.dtype) \
        -> Callable[[nn.Module, Any], torch.Tensor]:
    """``loss`` under autocast to ``dtype`` on the model's device, as the Trainer runs bf16/fp16 and Lightning
    its ``-mixed`` precisions (an estimate standing in for a GPU runs CUDA's autocast on its ``meta`` tensors;
    an estimate of the CPU the CPU's, which its FakeTensorMode applies)."""

    def autocast_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        kind = next(model.parameters()).device.type
        if kind == "meta":  # the estimate's: standing in for a GPU, CUDA's autocast; of the CPU, the CPU's
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.autocast(kind, dtype=dtype):
            return loss(model, batch)

    return autocast_loss


def make_optimizer(name: str) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """The optimizer ``name`` as Hugging Face's Trainer builds it (``adamw``: its ``adamw_torch``, torch's AdamW
    with its default implementation, foreach on a GPU: its temporaries are at least the fused kernel's, and
    the estimate's shape-only engine runs it)."""
    if name in NEEDS_BITSANDBYTES:
        raise needs_bitsandbytes(f"optimizer {name}", "plan with --optimizer adamw, sgd or adafactor")
    if name == "sgd":
        return functools.partial(torch.optim.SGD, lr=LEARNING_RATE)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return functools.partial(Adafactor, lr=LEARNING_RATE, scale_parameter=False, relative_step=False)
    return functools.partial(torch.optim.AdamW, lr=LEARNING_RATE, weight_decay=0.0)


#: peft's task type for each task (None: LoRA on the base model, every head's parameters frozen but the new ones).
PEFT_TASKS = {"causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM", "sequence-classification": "SEQ_CLS"}


def with_lora(model: nn.Module, settings: str, task: str) -> nn.Module:
    """``model`` with LoRA adapters (peft) as ``settings`` (``r=..,alpha=..,dropout=..,targets=..``) say."""
    try:
        import peft
    except ImportError:
        raise BadInput("lora needs peft (pip install peft), which is not installed: plan without --lora, or "
                       "install it") from None
    given = dict(part.split("=", 1) for part in settings.split(","))
    targets: str | list[str] = given["targets"] if given["targets"] == "all-linear" else given["targets"].split("+")
    config = peft.LoraConfig(r=int(given["r"]), lora_alpha=int(given["alpha"]), lora_dropout=float(given["dropout"]),
                             target_modules=targets, task_type=PEFT_TASKS.get(task))
    try:
        with warnings.catch_warnings():  # transformers 5 warns when peft reads is_gradient_checkpointing
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as exc:
        raise BadInput(f"lora {settings!r}: {exc}") from None


def make_model(config: Any, spec: ModelSpec, task: str) -> nn.Module:
    """A fresh model of ``config`` for ``task``, random weights in ``spec.dtype`` (else the config's dtype, as
    transformers builds it; none on ``meta``; mixed precision: fp32, but under LoRA the frozen weights in the
    config's dtype, as Hugging Face's Trainer with ``bf16=True`` trains peft's adapters over them), as
    ``spec`` trains it: gradient checkpointing as Hugging Face's Trainer enables it, LoRA through peft."""
    import transformers

    auto = getattr(transformers, AUTO[task][0])
    frozen_mixed = spec.dtype in AUTOCAST and spec.lora is not None  # LoRA's frozen weights: no fp32 masters
    dtype = {} if spec.dtype is None or frozen_mixed else {"dtype": DTYPES[spec.dtype]}
    model = auto.from_config(copy.deepcopy(config), **dtype)
    if spec.gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise BadInput(f"{type(model).__name__} does not support gradient checkpointing: drop "
                           "--gradient-checkpointing")
        model.config.use_cache = False  # as transformers sets it (with a warning) under checkpointing
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    if spec.padding == "packed":  # transformers reads a packed row's position ids only without a cache
        model.config.use_cache = False
    if qlora_bits(spec) == 4:
        from .qlora import quantize

        quantize(model, compute_dtype=AUTOCAST.get(spec.dtype or "", next(model.parameters()).dtype))
    if spec.lora is not None:
        model = with_lora(model, spec.lora, task)
    return model


def qlora_bits(spec: ModelSpec) -> int | None:
    """The bits of QLoRA's quantized base weights (``--lora ...,bits=4``), None for LoRA over the weights as built."""
    if spec.lora is None or ",bits=" not in spec.lora:
        return None
    return int(spec.lora.rpartition("bits=")[2])


@dataclass(frozen=True, kw_only=True)
class ModelWorkload(Workload):
    """A Workload built from a Hugging Face config, which also says what the model is (:meth:`facts`)."""

    about: Callable[[], ModelFacts] = field(repr=False)
    #: How a micro-batch's samples are padded (a plan in tokens counts the padding): to the longest, to a width
    #: of tokens, or not at all (None: packed, or no text).
    width: int | str | None = None

    def facts(self) -> ModelFacts:
        """The model's class, task and parameter counts, and the formula's figures."""
        return self.about()


def count(model: nn.Module) -> tuple[int, int]:
    """(total, trainable) parameters as transformers counts them, or peft under LoRA (a 4-bit weight as the
    weights it packs, as both count bitsandbytes' ``Params4bit``)."""
    from .qlora import Linear4bit

    packed = sum(m.in_features * m.out_features - m.weight.numel() for m in model.modules()
                 if isinstance(m, Linear4bit))
    counter = getattr(model, "get_nb_trainable_parameters", None)
    if callable(counter):
        trainable, total = counter()
        return int(total) + packed, int(trainable)
    hf: Any = model  # a PreTrainedModel
    return int(hf.num_parameters()) + packed, int(hf.num_parameters(only_trainable=True))


def facts_of(build: Callable[[], nn.Module], spec: ModelSpec, task: str, shape: Shape) -> ModelFacts:
    """What the model ``build`` makes is (built on ``meta``: no memory)."""
    with torch.device("meta"):
        model: Any = build()
    total, trainable = count(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    held: dict[str, int] = {}
    for p in model.parameters():
        name = "nf4" if p.dtype == torch.uint8 else next(k for k, v in DTYPES.items() if v == p.dtype) \
            if p.dtype in DTYPES.values() else str(p.dtype).removeprefix("torch.")
        held[name] = held.get(name, 0) + p.numel() * (2 if name == "nf4" else 1)  # two 4-bit weights a byte
    dtype = max(held, key=lambda d: held[d])  # LoRA's adapters may stay fp32 beside bf16 weights
    return ModelFacts(name=spec.name, architecture=type(base).__name__, task=task, total_parameters=total,
                      trainable_parameters=trainable, dtype=dtype, seq_len=shape.seq_len, lora=spec.lora,
                      formula_weights_bytes=weights, formula_adam_training_bytes=4 * weights,
                      config_source=config_source(spec.name), settings=spec.described(shape.seq_len))


def config_source(name: str) -> str:
    """Where the config of ``name`` is read: the hub's cache (at the revision it holds) or a local file."""
    if Path(name).is_absolute():
        return "a local config.json"
    snapshot = config_file(name).parent  # .../models--org--name/snapshots/<commit>/config.json
    revision = f" at revision {snapshot.name[:12]}" if snapshot.parent.name == "snapshots" else ""
    return f"the Hugging Face hub, {name}{revision} (huggingface_hub's cache)"


def items(batch: dict[str, torch.Tensor], *, task: str) -> int:
    """Tokens the model's loss averages over: a causal LM's shifted labels, a masked LM's masked ones."""
    labels = batch["labels"]
    if task == "causal-lm":
        return int((labels[:, 1:] != -100).sum())
    return int((labels != -100).sum())


def build(spec: ModelSpec) -> ModelWorkload:
    """The Workload of the model ``spec`` names, trained as it says."""
    if qlora_bits(spec) == 8:
        raise needs_bitsandbytes("QLoRA over 8-bit weights (lora bits=8)", "plan bits=4 (NF4, estimated by shape) or "
                                 "LoRA over unquantized weights (drop bits=)")
    config = load_config(spec.name)
    task = task_of(config, spec.task)
    if spec.num_labels is not None:
        config.num_labels = spec.num_labels
    shape = shape_of(spec, config, task)
    if shape.padding == "packed" and task != "causal-lm":
        raise BadInput(f"padding packed concatenates a causal LM's samples into one row, and {spec.name!r} is built "
                       f"for {task}: give padding longest or max")
    model = functools.partial(make_model, config, spec, task)
    about = functools.cache(functools.partial(facts_of, model, spec, task, shape))
    packed: dict[str, Any] = {"samples": packing.samples, "split": packing.split, "tokens": packing.tokens} \
        if shape.padding == "packed" else {"tokens": text_tokens} if shape.padding == "max" else \
        {"tokens": text_tokens, "split": functools.partial(split_padded, task=task)}
    text: dict[str, Any] = {} if shape.image is not None else {
        "lengths_batch": functools.partial(of_lengths, task=task, shape=shape), **packed,
        "width": {"longest": "longest", "max": shape.seq_len}.get(shape.padding)}
    loss = _loss_from_output(spec.name)
    if spec.dtype in AUTOCAST:  # fp16's GradScaler holds a scale and a flag: no memory to plan for
        loss = autocast_loss(loss, AUTOCAST[spec.dtype])
    return ModelWorkload(
        name=display_name(spec.name), model=model, batch=functools.partial(make_batch, task=task, shape=shape),
        loss=loss, optimizer=make_optimizer(spec.optimizer),
        items=functools.partial(items, task=task) if task in ("causal-lm", "masked-lm") else None, about=about,
        **text)
