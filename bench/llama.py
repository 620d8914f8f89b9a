"""Llama-shaped ``transformers`` models as autotune probe files: Llama-3.1-8B and a 70B, built from a config.

Nothing is downloaded and no weight is made: the estimate calls ``model()`` on
the ``meta`` device. Sequences of 2048 tokens, gradient checkpointing
(non-reentrant; :build_8b_lora_bf16 has bf16 weights instead), the model's own
causal-LM loss, AdamW (autotune's default).
Needs ``transformers`` (and ``peft`` for :build_8b_lora).

    autotune plan --probe bench/llama.py:build_8b --target-batch 512 --device estimate:H100-80GB*8 --parallel fsdp
    autotune plan --probe bench/llama.py:build_8b_lora --target-batch 512 --device estimate:H100-80GB
    autotune plan --probe bench/llama.py:build_8b_lora_bf16 --target-batch 512 --device estimate:H100-80GB
    autotune plan --probe bench/llama.py:build_70b --target-batch 512 --device estimate:H100-80GB*64 --parallel fsdp
"""

from __future__ import annotations

import functools

import torch

from autotune import Workload

SEQ_LEN = 2048
VOCAB = 128256
SHAPES = {  # the public configs' shapes
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336},
    "70b": {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
            "intermediate_size": 28672},
}


def model(size: str, lora: bool = False, bf16: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=131072, rope_theta=500000.0,
                         tie_word_embeddings=False, **SHAPES[size])
    net = LlamaForCausalLM(config)
    if bf16:  # bf16 weights, no checkpointing (each block's input dies once the next block returns)
        net = net.to(torch.bfloat16)
    else:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        net.enable_input_require_grads()
        net = get_peft_model(net, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"]))
    return net


def batch(size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (size, SEQ_LEN), generator=generator)
    return {"input_ids": ids, "labels": ids}


def loss(net: torch.nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return net(**data).loss


def _workload(name: str, size: str, lora: bool = False, bf16: bool = False) -> Workload:
    return Workload(name=name, model=functools.partial(model, size, lora, bf16), batch=batch, loss=loss)


def build_8b() -> Workload:
    """Llama-3.1-8B's shape (8.0B parameters)."""
    return _workload("llama-8b", "8b")


def build_8b_lora() -> Workload:
    """Llama-3.1-8B's shape with the base frozen and rank-16 LoRA adapters on the attention projections."""
    return _workload("llama-8b-lora", "8b", lora=True)


def build_8b_lora_bf16() -> Workload:
    """The LoRA 8B with bf16 weights and no gradient checkpointing."""
    return _workload("llama-8b-lora-bf16", "8b", lora=True, bf16=True)


def build_70b() -> Workload:
    """Llama-3.1-70B's shape (70.6B parameters)."""
    return _workload("llama-70b", "70b")


build = build_8b
