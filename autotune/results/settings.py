"""Every setting of a probe and a plan, declared once: its name, type, default, bounds or choices, help, and
which front ends show it.

A :class:`Setting` is data, beside the request types it fills (:mod:`autotune.results.request`): the command
line's flags (``autotune probe``, ``plan``, ``run``: :func:`autotune.cli.common.add_settings`), the service's
plan body (:mod:`autotune.serve.bodies`, built with pydantic's ``create_model``) and the API's keywords
(:func:`autotune.plan`, :func:`autotune.probe`: those people use typed by hand, their names and defaults held to
these declarations by ``tests/results/test_settings.py``, and any other one caught by their ``**settings``, checked
here at run time, :func:`keywords`) are made from it, under one name: the API's keyword and the body's field
are the name, the flag is ``--`` and the name with dashes (:func:`flag_of`). A surface that does not show a setting
says why in the declaration (``not_on``), and one that builds a setting's form by hand (``model``: a flag
group, a :class:`~autotune.results.model.ModelSpec`, a nested body) says where (``by_hand``). What only a
front end has (``--json``, ``--output``, ``store``...) is listed once, in :data:`FRONT_END_ONLY`.

A declaration is a plain dataclass rather than a pydantic model so that the command line builds its parser
without importing pydantic and the request types stay the library's own records; pydantic makes the
service's body of it, where it already is.

How to add a setting:

1. Declare it here, in :data:`SETTINGS` (:data:`MODEL` for how a model by name trains):
   ``Setting(name="my_knob", help=..., type=int, default=1, least=1, check=options.whole, verbs=PLAN)``; add
   ``not_on={"service": "why"}`` where a front end cannot take it, ``flag={...}`` or ``body={...}`` where one
   says it otherwise (a flag's ``action``, the service's own default or bound).
2. Give it its logic: a field of the request (:class:`~autotune.results.request.ProbeRequest` or
   :class:`~autotune.results.request.PlanRequest`), the keyword of
   :func:`autotune.planning.requests.plan_request` (or ``probe_request``) that fills it, and the stage that reads
   it. The flag, the body's field, the schema and the API's keyword come from the declaration: :func:`autotune.plan`
   takes it through ``**settings``, checked as declared, and hands it to ``plan_request``; type it there by hand
   too where people will use it (with the declared default). The command line
   (:func:`autotune.cli.plan_cmd.request_of`) and the service's body (``asked``) hand each value to
   ``plan_request`` by name: add it there.

No torch and no pydantic here.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import options
from ..errors import BadInput
from .model import DEFAULT_SEQ_LEN, DTYPES, OPTIMIZERS, PADDINGS, TASKS

#: The front ends, each showing a setting under the same name.
SURFACES = ("cli", "api", "service")
PROBE, PLAN = frozenset({"probe"}), frozenset({"plan"})
BOTH = PROBE | PLAN

#: What a front end takes that is no setting of a request: how it prints, where it writes, the plan store it
#: reads through, its environment. Listed once; the settings test leaves them out of each surface.
FRONT_END_ONLY: Mapping[str, frozenset[str]] = {
    "cli": frozenset({"help", "json", "output", "quiet", "verbose", "debug", "store", "report", "force", "format",
                      "dist_timeout"}),
    "api": frozenset({"store", "env"}),
    "service": frozenset(),
}

_NO_FILES = "a file on the service's machine: the service answers in JSON and writes no files"
_TUNING = "the service plans for a GPU it estimates, and tuning times real steps on the device"


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One setting of a probe or a plan (see the module's docstring).

    ``required``: a request must give it (``default`` is then none). ``type``: what a value is (``int``,
    ``float``, ``str``, ``bool``; ``object`` for a value of several kinds). ``least``/``most``: bounds,
    inclusive; ``below``: an exclusive upper bound. ``check``: the
    :mod:`autotune.options` check (``check(value, name)``) a flag's text goes through. ``verbs``: ``probe``,
    ``plan`` or both. ``not_on``: a front end that does not show it, and why; ``by_hand``: a front end that
    builds its form itself, and where. ``flag``/``body``: what differs on the command line (argparse's
    keywords) or in the service's body (``annotation``, ``default``, ``description``, pydantic ``Field``
    keywords). ``old_names``: names still accepted, with a DeprecationWarning, for one release.
    """

    name: str
    help: str
    type: type = str
    default: Any = None
    required: bool = False
    choices: tuple[Any, ...] = ()
    least: float | None = None
    most: float | None = None
    below: float | None = None
    check: Callable[..., Any] | None = None
    metavar: str | None = None
    verbs: frozenset[str] = BOTH
    not_on: Mapping[str, str] = field(default_factory=dict)
    by_hand: Mapping[str, str] = field(default_factory=dict)
    flag: Mapping[str, Any] = field(default_factory=dict)
    body: Mapping[str, Any] = field(default_factory=dict)
    old_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = (set(self.not_on) | set(self.by_hand)) - set(SURFACES)
        if unknown or set(self.not_on) & set(self.by_hand):
            raise ValueError(f"setting {self.name}: not_on and by_hand name surfaces among {SURFACES}, each once")

    @property
    def surfaces(self) -> frozenset[str]:
        """The front ends that show this setting."""
        return frozenset(SURFACES) - set(self.not_on)

    def shown(self, surface: str, verb: str) -> bool:
        return surface in self.surfaces and verb in self.verbs


def _one_or_per_rank(value: Any, name: str) -> int | tuple[int | None, ...] | None:
    """A memory budget, or one per rank (``8MiB,3MiB``)."""
    sizes = options.memory_budgets(value, name)
    return sizes[0] if len(sizes) == 1 else sizes


#: The settings, in the order the command line's help and the service's schema show them.
SETTINGS: tuple[Setting, ...] = (
    Setting(name="target_batch", type=int, required=True, least=1, most=options.MAX_TARGET_BATCH, check=options.whole,
            metavar="N", verbs=PLAN, help="effective batch per optimizer step, over all ranks"),
    Setting(name="target_tokens", type=int, least=1, check=options.whole, metavar="N", verbs=PLAN,
            not_on={"service": "the service plans a target batch"},
            help="tokens per optimizer step instead (exactly, or the closest whole samples, stated), samples of "
                 "--lengths FILE tokens, else what the loss counts in one sample; the plan's tokens hold every "
                 "step's tokens (autotune run --plan trains them, step by step)"),
    Setting(name="cut_samples", type=bool, default=False, verbs=PLAN,
            not_on={"service": "the service plans a target batch"},
            help="with --target-tokens: every step exactly N tokens, the sample that crosses N cut there"),
    Setting(name="lengths", verbs=PLAN, metavar="FILE", not_on={"service": _NO_FILES},
            by_hand={"cli": "autotune.cli.model_flags (one of a model's settings, or the samples' tokens alone)"},
            help="samples of these lengths (a column of a CSV, Parquet or JSONL file, or the one named length)"),
    Setting(name="probe", metavar="PROBE", old_names=("workload",),
            help="the workload: a built-in name (mlp, gpt, convnet, e.g. gpt:build_1b), a .py file, or "
                 "package.module[:function], exposing build() -> autotune.Workload (default: gpt)",
            body={"default": options.DEFAULT_PROBE, "max_length": 129,
                  "description": "a probe this service runs (GET /v1/probes): NAME or NAME:FUNCTION"}),
    Setting(name="model", type=object,
            by_hand={"cli": "autotune.cli.model_flags (--model NAME and its settings)",
                     "api": "a hub id, a folder or config.json, or an autotune.results.model.ModelSpec",
                     "service": "autotune.serve.models.ModelBody (a hub id and its settings)"},
            help="instead of the probe: a Hugging Face model by name, built from its config (weights are never "
                 "downloaded)"),
    Setting(name="device", default=options.DEVICE,
            help="auto (cuda:0 if there is a GPU, else cpu) | cpu | cuda | cuda:N | "
                 "estimate (fake tensors only; needs --memory-budget: the GPU you plan for) | "
                 "estimate:GPU (a GPU by name, e.g. estimate:H100-80GB; autotune devices --presets); "
                 "or one per rank: estimate:A100-80GB,estimate:T4-16GB (the world size is how many; "
                 "estimate:H100-80GB*4,estimate:A10G-24GB*4 for counts; under torchrun indexed by rank)",
            body={"default": "estimate", "max_length": 512,
                  "description": "estimate (with memory_budget) or an estimate preset, estimate:NAME; or one per "
                                 "rank, for ranks that differ: estimate:A100-80GB,estimate:T4-16GB (counts: "
                                 "estimate:H100-80GB*4,estimate:A10G-24GB*4)"}),
    Setting(name="memory_budget", type=object, check=_one_or_per_rank, metavar="SIZE",
            help="device memory to plan for, e.g. 512MiB or 80GiB (cpu: default the available RAM; cuda: caps the "
                 "free memory; estimate: required; estimate:GPU: replaces its memory); or one per rank, e.g. "
                 "8MiB,3MiB (under torchrun indexed by rank)",
            body={"description": "the GPU's memory, e.g. 80GiB; or one per rank, e.g. 80GiB,24GiB"}),
    Setting(name="margin", type=float, default=options.MARGIN, least=0, below=1, check=options.margin,
            help="fraction of capacity kept free: usable = capacity x (1 - margin)"),
    Setting(name="world_size", type=int, least=1, check=options.whole, metavar="W",
            help="data-parallel ranks: fsdp shards over them, ddp holds its gradient buckets when more than 1 "
                 "(default: the process group's, else $WORLD_SIZE, else 1)",
            body={"default": 1, "most": 65536}),
    Setting(name="max_batch", type=int, default=options.MAX_BATCH, least=1, check=options.whole, verbs=PROBE,
            not_on={"service": "the service plans, and a plan never needs more than its per-rank target"},
            flag={"metavar": None}, help="never search past this micro-batch size"),
    Setting(name="data_parallel", type=bool, verbs=PROBE,
            not_on={"cli": "the command line holds DDP's buckets when there are several ranks, as the default does",
                    "service": "the service plans"},
            help="under DDP, the fit rule holds DDP's gradient buckets (default: whether there are several ranks)"),
    Setting(name="parallel", choices=options.PARALLEL, default=options.DEFAULT_PARALLEL,
            help="how the ranks share the model: ddp (each holds all of it) or fsdp (fully_shard: each holds its "
                 "shard; the probe measures one rank of the world size)"),
    Setting(name="fsdp_sync", choices=options.FSDP_SYNCS, default=options.DEFAULT_FSDP_SYNC,
            help="under fsdp, when gradients are reduce-scattered: every micro-step (accumulated in their shards: "
                 "least memory), at the last micro-step only (unsharded gradients held between micro-steps: one "
                 "reduce-scatter a step), or auto: the one with the larger max micro-batch, last on a tie",
            body={"description": "under fsdp, when gradients are reduce-scattered: every micro-step, the last one, "
                                 "or auto"}),
    Setting(name="precision", choices=options.PRECISIONS, default="fp32",
            not_on={"cli": "on the command line --precision is autotune run's (how it trains); a probe measures "
                           "fp32, as the workload builds its model"},
            help="the precision probed: fp32, what the fit rule measures (the only precision probed)",
            body={"choices": ("fp32",),
                  "description": "fp32, what the fit rule measures (the only precision planned)"}),
    Setting(name="multiple_of", type=int, default=1, least=1, most=options.MAX_TARGET_BATCH, check=options.whole,
            metavar="Q", verbs=PLAN, help="every micro-batch a multiple of Q (e.g. 8 for tensor cores)"),
    Setting(name="uniform", type=object, choices=(None, True, "force"), verbs=PLAN,
            help="null: the fewest steps; true: equal micro-batches within twice the fewest steps; \"force\": equal "
                 "micro-batches however many steps they take",
            flag={"action": "store_true", "default": False,
                  "help": "equal micro-batches, however many accumulation steps they take (fails only when the "
                          "target is not a multiple of the ranks x --multiple-of)"}),
    Setting(name="uniform_ranks", type=bool, default=False, verbs=PLAN,
            help="ranks that differ (devices, memory held by others) all run the smallest rank's max micro-batch "
                 "and the same micro-steps, instead of each its own"),
    Setting(name="tune", type=bool, default=False, verbs=PLAN, not_on={"service": _TUNING},
            help="time real steps of candidate plans (and the probe's options) with optuna, the untuned plan first; "
                 "keep the fastest unless it is within noise of the untuned one"),
    Setting(name="trials", type=int, default=options.TRIALS, least=1, check=options.whole, metavar="N", verbs=PLAN,
            not_on={"service": _TUNING},
            help="candidates --tune measures, each once (all of them when there are fewer)"),
    Setting(name="storage", metavar="URL", verbs=PLAN, not_on={"service": _TUNING},
            help="optuna storage for --tune, e.g. sqlite:///reports/tune.db (resumable, optuna-dashboard)"),
    Setting(name="study_name", metavar="NAME", verbs=PLAN, not_on={"service": _TUNING},
            help="optuna study for --tune (default: autotune-<probe>-<target>-<digest of the settings>)"),
    Setting(name="search_settings", type=bool, default=False, verbs=PLAN,
            help="try the settings that do not change what is computed (ddp or fsdp and its gradient sync, on a GPU "
                 "fsdp with CPU offload, activation checkpointing of none, every, or every 2nd repeated block, the "
                 "allocator's expandable segments), each by estimate; rank them by a stated time model (roofline "
                 "compute with recompute, collectives over the GPU's link, offload's copies over PCIe and its "
                 "optimizer step on the CPU) and plan the fastest; on a real device the best two are run and timed"),
    Setting(name="allow", metavar="LIST", verbs=PLAN, body={"max_length": 64},
            help="with --search-settings, also try these settings that change the numbers: bf16-mixed, bf16, lora "
                 "(bf16 and lora: a model by name, --model)"),
    Setting(name="memory_snapshot", type=object, metavar="FILE", not_on={"service": _NO_FILES},
            help="also write the fit rule's allocations at the chosen micro-batch as torch.cuda.memory._snapshot() "
                 "does (open it with python -m torch.cuda._memory_viz trace_plot FILE -o out.html, or "
                 "pytorch.org/memory_viz), and say where the peak comes from, what would lower it most and which "
                 "allocator settings fit more; on a GPU the real snapshot goes beside it (FILE.real.pickle)"),
    Setting(name="at", type=int, least=1, check=options.whole, metavar="N", not_on={"service": _NO_FILES},
            help="the micro-batch of --memory-snapshot (default: the chosen one)"),
)

#: How a model by name trains (``--model NAME --seq-len 512``; the service's ``"model": {"name": ..., "seq_len":
#: 512}``; the API's ``ModelSpec(name, seq_len=512)``): the fields of :class:`~autotune.results.model.ModelSpec`,
#: which checks them. A flag left out is None, for ModelSpec's default.
MODEL_VERB = frozenset({"model"})
_TOKENS: dict[str, Any] = {"type": int, "least": 1, "most": 1 << 20, "metavar": "N", "verbs": MODEL_VERB}
MODEL: tuple[Setting, ...] = (
    Setting(name="task", choices=TASKS, verbs=MODEL_VERB,
            help="what the model is trained for (default: the one the config's architectures name)"),
    Setting(name="seq_len", **_TOKENS,
            help=f"tokens in every sample (default: the config's maximum positions, at most {DEFAULT_SEQ_LEN})"),
    Setting(name="target_len", **_TOKENS, help="a seq2seq model's label tokens (default: --seq-len)"),
    Setting(name="num_labels", **_TOKENS, help="a classifier's classes (default: the config's)"),
    Setting(name="optimizer", choices=OPTIMIZERS, verbs=MODEL_VERB,
            help="adamw (torch's AdamW, Hugging Face Trainer's adamw_torch), sgd, adafactor; the 8-bit ones and lion "
                 "need bitsandbytes (default: adamw)",
            body={"choices": ("adamw", "sgd", "adafactor"), "default": "adamw"}),  # no bitsandbytes there
    Setting(name="lora", metavar="SETTINGS", verbs=MODEL_VERB, flag={"nargs": "?", "const": ""},
            help="train LoRA adapters through peft, e.g. r=16,alpha=32,dropout=0.05,targets=all-linear (those are the "
                 "defaults; targets=q_proj+v_proj names modules; bits=4 is QLoRA: NF4 base weights with double "
                 "quantization, estimated by shape; bits=8 needs bitsandbytes)",
            body={"max_length": 200, "description": "e.g. r=16,alpha=32,dropout=0.05,targets=all-linear"}),
    Setting(name="gradient_checkpointing", type=bool, verbs=MODEL_VERB, body={"default": False},
            help="as Hugging Face's Trainer enables it (non-reentrant)"),
    Setting(name="dtype", metavar="DTYPE", verbs=MODEL_VERB, body={"choices": tuple(DTYPES)},
            help="the weights' dtype: fp32, bf16 or fp16 (Lightning's 32-true, bf16-true, 16-true too; default: the "
                 "config's, as transformers builds it; fp32 when it names none), or mixed precision: bf16-mixed, "
                 "16-mixed (fp32 weights, the forward under autocast)"),
    Setting(name="lengths", metavar="FILE", verbs=MODEL_VERB, not_on={"service": _NO_FILES},
            help="samples of these lengths (a column of a CSV, Parquet or JSONL file, or the one named length); "
                 "--seq-len then truncates them (default: the longest)"),
    Setting(name="padding", choices=PADDINGS, verbs=MODEL_VERB,
            not_on={"service": "the service's model has no file of sample lengths to pad"},
            help="with --lengths: pad a micro-batch to its longest sample (longest), or every sample to --seq-len "
                 "(max), or concatenate a causal LM's samples into one row as DataCollatorWithFlattening does "
                 "(packed; the plan says what packing saves) (default: longest)"),
)
#: The names of a model's settings.
MODEL_SETTINGS = tuple(s.name for s in MODEL)

_BY_NAME = {s.name: s for s in SETTINGS}


def setting(name: str) -> Setting:
    """The declaration of ``name`` (KeyError for no setting)."""
    return _BY_NAME[name]


def settings_of(verb: str, surface: str, declared: tuple[Setting, ...] | None = None) -> Iterator[Setting]:
    """The settings ``surface`` shows for ``verb``, in their declared order."""
    return (s for s in (SETTINGS if declared is None else declared) if s.shown(surface, verb))


def flag_of(name: str) -> str:
    """The command line's flag of a setting (or of any field named as a setting is): ``--memory-budget``."""
    return "--" + name.replace("_", "-")


def keywords(verb: str, given: Mapping[str, Any], *, typed: Collection[str]) -> dict[str, Any]:
    """The settings of ``verb`` given to the API beyond the keywords it types by hand (``typed``), as
    :func:`autotune.plan` (or :func:`autotune.probe`) catches them, each checked as declared (:func:`checked`).
    TypeError for a keyword no setting of ``verb`` is, naming the closest that is, as Python says it of a keyword
    a function does not take."""
    caught = {s.name: s for s in settings_of(verb, "api") if s.name not in typed}
    for name in given:
        if name not in caught:
            closest = difflib.get_close_matches(name, [s.name for s in settings_of(verb, "api")], n=1)
            raise TypeError(f"{verb}() got an unexpected keyword argument {name!r}" +
                            (f"; did you mean {closest[0]!r}?" if closest else ""))
    return {name: checked(caught[name], value) for name, value in given.items()}


def checked(declared: Setting, value: Any) -> Any:
    """``value`` of the setting ``declared``, checked as declared: its check (a yes-or-no for a bool), its choices,
    its bounds; BadInput naming the setting where it is refused. None, the value of a setting left to its default,
    stays None."""
    name = declared.name
    if value is None and declared.default is None and not declared.required:
        return None
    if declared.check is not None:
        value = declared.check(value, name)
    elif declared.type is bool:
        value = options.boolean(value, name)
    elif declared.type is not object and not isinstance(value, declared.type):
        raise BadInput(f"must be a {declared.type.__name__}, not a {type(value).__name__}", field=name, value=value)
    if declared.choices and value not in declared.choices:
        raise BadInput(f"must be one of {', '.join(map(str, declared.choices))}", field=name, value=value,
                       choices=declared.choices)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _within(declared, value)
    return value


def _within(declared: Setting, value: float) -> None:
    """BadInput, naming the setting, for a number outside its declared bounds."""
    for limit, words, refused in ((declared.least, "at least", lambda b: value < b),
                                  (declared.most, "at most", lambda b: value > b),
                                  (declared.below, "below", lambda b: value >= b)):
        if limit is not None and refused(limit):
            raise BadInput(f"must be {words} {limit}", field=declared.name, value=value, limit=limit)
