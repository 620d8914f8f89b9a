"""Public LLM configs on GPU presets: `autotune probe --model DIR` beside `accelerate estimate-memory`'s figure.

    python bench/hf_models.py                        # every row (an FSDP row 1.5-4 min here, a 70B one longer)
    python bench/hf_models.py --quick                # the 8B on one A100, full and LoRA, seq 2048
    python bench/hf_models.py --only 8B,Qwen --seq 2048
    python bench/hf_models.py --dtype bf16-mixed     # autocast over fp32 weights (LoRA: over the frozen bf16 ones)

The config.json of Llama-3.1-8B, Qwen2.5-7B, Mistral-7B-v0.1 and Llama-3.1-70B (their public values) are
written to a temporary folder; each row runs ``autotune probe --model DIR --json --dtype bf16-true
--gradient-checkpointing`` in its own process (``OMP_NUM_THREADS=1``) and prints the max micro-batch (or what
the smallest one needs when none fits), the reserved peak at it, total and trainable parameters, the formula
of ``accelerate estimate-memory`` (Adam training as 4x the weights; the result's ``model`` part) and the
process's wall and CPU seconds (user + system, its own). ``--dtype``: bf16 weights (``bf16-true``, the
default) or ``bf16-mixed`` (autocast to bf16 over fp32 weights; under LoRA over the frozen bf16 weights, fp32
adapters). QLoRA (``--lora ...,bits=4``) is NF4 base weights estimated by shape (autotune/workload/qlora.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

from common import machine

from autotune.units import format_bytes

COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
         "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": 128001,
         "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
CONFIGS: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B": {**COMMON, **LLAMA, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256},
    "Qwen2.5-7B": {**COMMON, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "intermediate_size": 18944, "vocab_size": 152064, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "max_position_embeddings": 131072, "sliding_window": 131072, "use_sliding_window": False},
    "Mistral-7B-v0.1": {**COMMON, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                        "rope_theta": 10000.0, "max_position_embeddings": 32768, "sliding_window": 4096},
    "Llama-3.1-70B": {**COMMON, **LLAMA, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256},
}
DEVICES = [("A100-80GB", ["--device", "estimate:A100-80GB"]),
           ("A10G-24GB", ["--device", "estimate:A10G-24GB"]),
           # one rank of 8 (a probe measures one rank; estimate:H100-80GB*8 is a plan's device list)
           ("H100-80GB x8 FSDP", ["--device", "estimate:H100-80GB", "--parallel", "fsdp", "--world-size", "8"])]
LORA = "r=16,alpha=32,dropout=0.05,targets=all-linear"
MODES = [("full", []), ("LoRA", ["--lora", LORA]), ("QLoRA", ["--lora", LORA + ",bits=4"])]
QUICK = {("Llama-3.1-8B", "A100-80GB", "full", 2048), ("Llama-3.1-8B", "A100-80GB", "LoRA", 2048)}


def write_configs(folder: str) -> dict[str, str]:
    """Each model's folder, holding its config.json."""
    paths = {}
    for name, config in CONFIGS.items():
        path = os.path.join(folder, name)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        paths[name] = path
    return paths


def child_cpu() -> float:
    """CPU seconds (user + system) of the child processes waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def probe(model_dir: str, seq: int, extra: list[str],
          dtype: str = "bf16-true") -> tuple[dict | None, str, float, float]:
    """The probe's JSON (None on failure), its last error line, wall seconds, CPU seconds."""
    argv = [sys.executable, "-m", "autotune", "probe", "--model", model_dir, "--json", "--seq-len", str(seq),
            "--dtype", dtype, "--gradient-checkpointing", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    begin, cpu = time.perf_counter(), child_cpu()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall, cpu = time.perf_counter() - begin, child_cpu() - cpu
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    error = lines[-1] if lines else f"exit {done.returncode}"
    result = json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else None
    return result, error, wall, cpu


def meta_count(model_dir: str, lora: bool, dtype: str = "bf16-true") -> tuple[str, str]:
    """Parameters and accelerate's formula (the weights' bytes, Adam training 4x) counted on the meta device
    here (without LoRA's adapters, whose count is left open): bf16 weights, fp32 under full bf16-mixed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        total = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).num_parameters()
    trainable = "adapters not counted" if lora else f"{total / 1e9:.2f}B"
    size = 4 if dtype.endswith("-mixed") and not lora else 2
    return f"{total / 1e9:.2f}B / {trainable} *", format_bytes(total * size * 4) + " *"


def cells(result: dict | None, error: str, model_dir: str, lora: bool,
          dtype: str = "bf16-true") -> tuple[str, str, str, str]:
    """Max micro-batch (or why none), reserved peak, total/trainable parameters, accelerate's formula."""
    if result is None:
        if "bitsandbytes" in error:
            return "refused: needs bitsandbytes", "", "", ""
        found = re.search(r"micro-batch 1 needs ([\d.]+ \w+).*?usable memory is ([\d.]+ \w+)", error)
        if not found:
            return error.removeprefix("autotune probe: error: ")[:220], "", "", ""
        fit = f"does not fit: needs {found[1]} at micro-batch 1 (usable {found[2]})"
        return (fit, "", *meta_count(model_dir, lora, dtype))
    facts = result.get("model") or {}
    params = f"{facts.get('total_parameters', 0) / 1e9:.2f}B / {facts.get('trainable_parameters', 0) / 1e9:.3g}B"
    formula = format_bytes(facts.get("formula_adam_training_bytes", 0))
    return str(result["max_micro_batch"]), format_bytes(result["peak_bytes"]), params, formula


def rows(args: argparse.Namespace) -> list[tuple[str, str, list[str], str, list[str], int]]:
    """The rows to run: single GPUs before FSDP, then by seq, device, model and mode."""
    order = [(s, d) for fsdp in (False, True) for s in args.seq for d in DEVICES if fsdp == ("--parallel" in d[1])]
    chosen = []
    for seq, (device, dev_args) in order:
        for model in CONFIGS:
            for mode, mode_args in MODES:
                name = f"{model} {device} {mode} {seq}"
                if args.quick and (model, device, mode, seq) not in QUICK:
                    continue
                if args.only and not any(w in name for w in args.only.split(",")):
                    continue
                chosen.append((model, device, dev_args, mode, mode_args, seq))
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 8B on one A100, full and LoRA, seq 2048")
    parser.add_argument("--only", default=None, help="rows whose 'model device mode seq' contains one of these "
                                                     "(comma-separated), e.g. 8B,A10G")
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096], help="tokens a sample")
    parser.add_argument("--dtype", default="bf16-true", help="bf16-true (default) or bf16-mixed")
    args = parser.parse_args()
    print(machine())
    print(f"autotune probe --model DIR --dtype {args.dtype} --gradient-checkpointing --json (each row its own "
          "process)\n")
    print("| model | device | mode | seq | max micro-batch | reserved peak | params total / trainable "
          "| accelerate formula (Adam, 4x weights) | wall s | CPU s |")
    print("|---|---|---|---:|---|---:|---|---:|---:|---:|", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        paths = write_configs(folder)
        for model, device, dev_args, mode, mode_args, seq in rows(args):
            result, error, wall, cpu = probe(paths[model], seq, dev_args + mode_args, args.dtype)
            batch, peak, params, formula = cells(result, error, paths[model], mode != "full", args.dtype)
            print(f"| {model} | {device} | {mode} | {seq} | {batch} | {peak} | {params} | {formula} "
                  f"| {wall:.1f} | {cpu:.1f} |", flush=True)
    print("\n* where marked: counted here on the meta device (the probe stopped before its model part)")


if __name__ == "__main__":
    main()
