"""What the estimate makes of code written for CUDA, on two GPU presets.

    python bench/cuda_code.py                      # A10G-24GB (sm86) and H100-80GB (sm90), ~3 min on 2 cores
    python bench/cuda_code.py --presets A100-40GB  # other presets (autotune devices --presets)
    python bench/cuda_code.py --peak-parts         # gpt:build_100m on A10G-24GB: the bytes at the peak by kind

One GPT shape (32k vocabulary, 512 tokens, 512 wide, 8 heads of 64, 4
layers, dropout 0.1), trained as people write it for a GPU: in fp32; with
bf16 weights (``model.to(torch.bfloat16)``), attention causal through
``is_causal`` and through an explicit boolean mask; under
``torch.autocast("cuda", bfloat16)``; under ``autocast("cuda", float16)``
(what a GradScaler trains: the fit rule runs no scaler, whose state is one
float); with ``AdamW(fused=True)``; and ``torch.compile``'d. For each, on
each preset, an estimate-only probe (``--device estimate:GPU``): the max
micro-batch, the attention backend the estimate stood in for and why (its
note, first kind only), and seconds per estimate evaluation (the mean over
the probe's evaluations). A workload the estimate refuses prints its error.

autocast("cuda"), fused optimizers and ``torch.cuda.is_available()`` inside
the estimate come with the CUDA stand-in of the estimate session: where it
is missing, autocast("cuda") is off (torch warns that CUDA is unavailable)
and those rows are estimated in fp32, as the backend column shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import warnings

import torch
from common import machine
from torch import nn
from torch.nn import functional as F

from autotune import api
from autotune.probes import gpt

CONFIG = gpt.Config(vocab=32000, seq_len=512, d_model=512, heads=8, layers=4, min_len=128)
PRESETS = ("A10G-24GB", "H100-80GB")
NOTE = "scaled_dot_product_attention as CUDA runs it: "


class MaskedBlock(gpt.Block):
    """The block with its causal mask as an explicit boolean ``attn_mask`` (flash attention takes none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.drop.p if self.drop.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


def masked_bf16() -> nn.Module:
    model = gpt.GPT(CONFIG)
    model.blocks = nn.ModuleList(MaskedBlock(CONFIG) for _ in range(CONFIG.layers))
    return model.to(torch.bfloat16)


def autocast_loss(dtype: torch.dtype, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cuda", dtype=dtype):
        logits = model(batch["tokens"])
    return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten(), ignore_index=gpt.IGNORE)


def workloads() -> dict[str, object]:
    base = gpt._workload("gpt-40m", CONFIG)
    return {
        "fp32": base,
        "bf16 weights, is_causal": dataclasses.replace(base, model=lambda: gpt.GPT(CONFIG).to(torch.bfloat16)),
        "bf16 weights, boolean mask": dataclasses.replace(base, model=masked_bf16),
        "autocast(cuda, bf16)": dataclasses.replace(base, loss=functools.partial(autocast_loss, torch.bfloat16)),
        "autocast(cuda, fp16) (GradScaler)": dataclasses.replace(
            base, loss=functools.partial(autocast_loss, torch.float16)),
        "AdamW(fused=True)": dataclasses.replace(base, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)),
        "torch.compile": dataclasses.replace(base, model=lambda: torch.compile(gpt.GPT(CONFIG))),
    }


def attention(notes: tuple[str, ...]) -> str:
    """The first attention note, without its prefix; '-' when the estimate ran no attention."""
    return next((n[len(NOTE):] for n in notes if n.startswith(NOTE)), "-")


def row(name: str, workload: object, preset: str) -> tuple[str, ...]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # autocast("cuda") without the CUDA stand-in warns once per probe
            result = api.probe(workload, device=f"estimate:{preset}", max_batch=4096)
    except Exception as exc:  # a workload the estimate refuses is a row of the table, not the end of it
        return name, preset, "error", str(exc).splitlines()[0][:100], "-"
    seconds = [t.seconds for t in result.trials if t.source == "estimate"]
    compiled = " [estimated eager]" if any("is compiled (torch.compile)" in n for n in result.notes) else ""
    return (name, preset, str(result.max_micro_batch), attention(result.notes) + compiled,
            f"{statistics.mean(seconds):.2f}" if seconds else "-")


def group(name: str, kind: str) -> str:
    """A part of the peak (the memory timeline's kind and module) as the peak-parts table groups it."""
    if kind != "activations":
        return {"cache": "cached free blocks (fragmentation)", "rounding": "cached free blocks (fragmentation)",
                "context": "CUDA context (allowance)"}.get(kind, kind.replace("_", " "))
    if name.startswith("(outside"):
        return "activations: the loss (logits' log-softmax and its gradients)"
    return "activations: the 12 blocks" if name.startswith("blocks") else "activations: embeddings' dropout, head, norm"


def peak_parts(preset: str) -> None:
    """gpt:build_100m in fp32, under autocast("cuda", bf16) and converted to bf16 on ``preset``: the max
    micro-batch and, at it, the peak's bytes by kind (from the estimate's memory timeline at its peak)."""
    base = gpt.build_100m()
    runs = {"fp32": base, "autocast(cuda, bf16)": dataclasses.replace(
        base, loss=lambda m, b: _autocast_gpt_loss(m, b)), "bf16 weights": dataclasses.replace(
        base, model=lambda: base.model().to(torch.bfloat16))}
    results = {name: api.probe(w, device=f"estimate:{preset}", memory_snapshot=True) for name, w in runs.items()}
    print(f"| part at the peak (gpt:build_100m, estimate:{preset}) | " +
          " | ".join(f"{n}: max {r.max_micro_batch}" for n, r in results.items()) + " |")
    print("|---|" + "---:|" * len(results))
    grouped = {}
    for name, r in results.items():
        assert r.memory is not None
        for part in r.memory.parts:
            key = group(part.name, part.kind)
            grouped.setdefault(key, {}).setdefault(name, 0)
            grouped[key][name] += part.bytes
    for key, by in grouped.items():
        print(f"| {key} | " + " | ".join(
            f"{by.get(n, 0) / 2**30:.2f} GiB ({by.get(n, 0) / r.memory.batch / 2**20:.0f} MiB a sample)"
            for n, r in results.items() if r.memory is not None) + " |")
    print("| reserved peak (what the fit rule compares) | " + " | ".join(
        f"{r.memory.reserved_peak_bytes / 2**30:.2f} GiB, at {r.memory.peak_phase}" for r in results.values()
        if r.memory is not None) + " |")


def _autocast_gpt_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):  # the whole loss, as a GPU script writes it
        return gpt.loss(model, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--peak-parts", action="store_true", help="gpt:build_100m in fp32, under autocast and in "
                        "bf16 on the first preset (A10G-24GB): the peak's bytes by kind")
    args = parser.parse_args()
    print(machine())
    if args.peak_parts:
        peak_parts(args.presets[0])
        return
    print(f"# GPT {CONFIG.vocab} vocab, {CONFIG.seq_len} tokens, {CONFIG.d_model} wide, {CONFIG.heads} heads, "
          f"{CONFIG.layers} layers; estimate-only probes, 10% margin")
    print("| workload | preset | max micro-batch | attention (backend on the GPU: why) | s / evaluation |")
    print("|---|---|---|---|---|")
    for name, workload in workloads().items():
        for preset in args.presets:
            print("| " + " | ".join(row(name, workload, preset)) + " |", flush=True)


if __name__ == "__main__":
    main()
