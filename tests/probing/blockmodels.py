"""Small models of repeated blocks the block-replay and step-reuse tests estimate."""

from __future__ import annotations

import torch
from torch import nn

from autotune.workload import Workload
from probes import gpt

BIG = 10**15


def gpt_blocks(layers: int = 6, checkpointing: bool = False) -> Workload:
    c = gpt.Config(vocab=256, seq_len=16, d_model=32, heads=2, layers=layers)
    return gpt._workload("gpt", c).configure(checkpointing=checkpointing)


def llama_blocks(checkpointing: bool, dtype: torch.dtype = torch.float32) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)

    def model() -> nn.Module:
        net = LlamaForCausalLM(config)
        if checkpointing:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return net.to(dtype)

    return Workload(name="llama", model=model, batch=lambda n, g: torch.randint(0, 256, (n, 32), generator=g),
                    loss=lambda m, ids: m(input_ids=ids, labels=ids).loss)
