"""Tiny Hugging Face configs, written where a test asks: one per kind of model ``--model`` builds."""

from __future__ import annotations

import json
from pathlib import Path

import transformers

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
#: (config class, its keywords, architecture, the task it is built for, the auto class that builds it)
CONFIGS = {
    "llama": ("LlamaConfig", TINY, "LlamaForCausalLM", "causal-lm"),
    "qwen2": ("Qwen2Config", TINY, "Qwen2ForCausalLM", "causal-lm"),
    "mistral": ("MistralConfig", TINY, "MistralForCausalLM", "causal-lm"),
    "gemma2": ("Gemma2Config", {**TINY, "head_dim": 8}, "Gemma2ForCausalLM", "causal-lm"),
    "gpt2": ("GPT2Config", dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64), "GPT2LMHeadModel",
             "causal-lm"),
    "t5": ("T5Config", dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=0,
                            decoder_start_token_id=0),
           "T5ForConditionalGeneration", "seq2seq-lm"),
    "bert": ("BertConfig", dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=64), "BertForMaskedLM", "masked-lm"),
    "bert-cls": ("BertConfig", dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, max_position_embeddings=64, num_labels=3),
                 "BertForSequenceClassification", "sequence-classification"),
    "vit": ("ViTConfig", dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, num_labels=5), "ViTForImageClassification",
            "image-classification"),
}
AUTO = {"causal-lm": "AutoModelForCausalLM", "seq2seq-lm": "AutoModelForSeq2SeqLM", "masked-lm": "AutoModelForMaskedLM",
        "sequence-classification": "AutoModelForSequenceClassification",
        "image-classification": "AutoModelForImageClassification"}


def config_of(kind: str) -> transformers.PretrainedConfig:
    cls, kwargs, arch, _ = CONFIGS[kind]
    return getattr(transformers, cls)(**kwargs, architectures=[arch])


def write_config(folder: Path, kind: str, **extra: object) -> Path:
    """A model folder holding only the config.json of a tiny ``kind`` model."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config_of(kind).to_dict(), **extra}))
    return folder
