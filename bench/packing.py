"""Padding to the longest vs padding-free packing, for one length distribution, on the CPU (real runs).

A tiny Llama (transformers, random weights) by config, ``--model DIR --lengths FILE``, trained with
``--padding longest`` (each micro-batch padded to its longest sample) and ``--padding packed`` (the samples
of a micro-batch in one row, as ``DataCollatorWithFlattening`` makes it, attention kept inside each sample):

- max samples per micro-batch: ``autotune.plan(target_batch=...)`` on the CPU under one memory budget (the
  probe's worst case: the micro-batch's longest samples), and its peak;
- real tokens per second: ``autotune.run`` of ``autotune.plan(target_tokens=...)`` over the lengths in data
  order (every step the same tokens, each micro-batch padded or packed), the loss's tokens per second, and the
  run's peak beside the probe's (timed with the memory tracker on, as every CPU run is; trained under
  ``--run-budget``, so a run over the probe's peak is printed rather than stopped).

    python bench/packing.py            # ~2-4 min here
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine  # noqa: E402

CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512)


def lengths(count: int, seed: int = 0) -> list[int]:
    """A long-tailed distribution of sample lengths, as chat or instruction data has: log-normal, 16..512."""
    rng = random.Random(seed)
    return [min(512, max(16, int(rng.lognormvariate(4.3, 0.8)))) for _ in range(count)]


def row(padding: str, folder: Path, file: Path, args: argparse.Namespace) -> dict:
    import autotune
    from autotune.results.model import ModelSpec

    spec = ModelSpec(name=str(folder), lengths=str(file), padding=padding)
    common = dict(model=spec, device="cpu", memory_budget=args.budget, store=False)
    sized = autotune.plan(target_batch=args.target_batch, **common)
    tokens = autotune.plan(target_tokens=args.target_tokens, lengths=str(file), **common)
    run = autotune.run(plan=tokens, steps=args.steps, model=spec, device="cpu", memory_budget=args.run_budget)
    held = [c for c in run.verification.checks if c.name != "memory"]  # the run's peak is printed, not held
    assert all(c.passed for c in held), [c.message for c in held if not c.passed]
    steps = tokens.tokens.steps
    return {"padding": padding, "max_micro_batch": sized.max_micro_batch, "probe_peak": sized.probe.peak_bytes,
            "micro_tokens": tokens.tokens.micro_tokens, "micro_batches_per_step": sum(
                len(s.micro_batches) for s in steps[:args.steps]) / min(args.steps, len(steps)),
            "tokens_per_s": run.items_per_s, "run_peak": run.peak_bytes, "predicted": tokens.probe.peak_bytes,
            "note": next((n for n in sized.notes if n.startswith("packing")), "")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", default="64MiB", help="the memory budget planned for")
    p.add_argument("--run-budget", default="256MiB", help="the CPU capacity the runs train under")
    p.add_argument("--target-batch", type=int, default=64)
    p.add_argument("--target-tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--samples", type=int, default=2000)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(machine())
    sizes = lengths(args.samples)
    ordered = sorted(sizes)
    print(f"# {len(sizes)} samples of {ordered[0]}..{ordered[-1]} tokens (median {ordered[len(sizes) // 2]}, mean "
          f"{sum(sizes) / len(sizes):.0f}); budget {args.budget}; target batch {args.target_batch}; target tokens "
          f"{args.target_tokens}; {args.steps} steps")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(CONFIG))
        file = Path(tmp) / "lengths.csv"
        file.write_text("length\n" + "\n".join(map(str, sizes)))
        rows = [row(padding, folder, file, args) for padding in ("longest", "packed")]
    mib = 2 ** 20
    print("| padding | max samples per micro-batch (probe peak) | micro-batch tokens | micro-batches per step | "
          "real tokens/s (CPU run) | run peak (probe's) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['padding']} | {r['max_micro_batch']} ({r['probe_peak'] / mib:.1f} MiB) | {r['micro_tokens']} | "
              f"{r['micro_batches_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {r['run_peak'] / mib:.1f} MiB "
              f"({r['predicted'] / mib:.1f} MiB) |")
    print(f"\n{rows[1]['note']}")


if __name__ == "__main__":
    main()
