"""Training setups people run most, as small CPU workloads: each a case the estimate must hold on.

1. Hugging Face models on padded batches (transformers reads the padding mask's values):
   :func:`hf_llama` (GQA, RoPE, gradient checkpointing, right padding), :func:`hf_gpt2`,
   :func:`hf_t5`, and :func:`peft_lora_qwen2` (a LoRA adapter from peft, when peft is installed).
2. Ops whose output shape comes from the batch's values: :func:`packed_gru`
   (``pack_padded_sequence``) and :func:`ctc` (``F.ctc_loss`` with tensor lengths).
3. Memory that is not linear in the batch: :func:`in_batch_negatives` (a ``(B, B, ...)``
   late-interaction similarity).
4. Flat estimates at small sizes: :func:`lstm` (the optimizer step sets the peak at 2 and 3).
5. Routing that depends on parameters: ``tests.workloads.moe``.

Every builder returns a fresh :class:`autotune.Workload` built from configs (no downloads);
:data:`CASES` names them with a CPU memory budget at which the answer is well inside the search.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import nn
from torch.nn import functional as F

from autotune.workload import Workload

from . import workloads

VOCAB = 96
PAD = 0


def _padded_tokens(n: int, g: torch.Generator, *, longest: int, shortest: int) -> dict[str, torch.Tensor]:
    """Right-padded token rows of random lengths, one row at the longest length (the worst case)."""
    lengths = torch.randint(shortest, longest + 1, (n,), generator=g)
    lengths[0] = longest
    ids = torch.randint(3, VOCAB, (n, longest), generator=g)
    mask = (torch.arange(longest).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = ids.masked_fill(mask == 0, PAD)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _llama(checkpointing: bool = True) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=PAD, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def hf_llama() -> Workload:
    """An HF Llama (GQA, RoPE, gradient checkpointing) on right-padded batches of up to 48 tokens."""
    return Workload(name="hf-llama-padded", model=_llama,
                    batch=functools.partial(_padded_tokens, longest=48, shortest=8), loss=_hf_loss,
                    items=lambda b: int((b["labels"][:, 1:] != -100).sum()))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128, bos_token_id=1,
                        eos_token_id=2, pad_token_id=PAD)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def hf_gpt2() -> Workload:
    """An HF GPT-2 on right-padded batches of up to 48 tokens."""
    return Workload(name="hf-gpt2-padded", model=_gpt2,
                    batch=functools.partial(_padded_tokens, longest=48, shortest=8), loss=_hf_loss)


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, pad_token_id=PAD, decoder_start_token_id=PAD, eos_token_id=1)
    return T5ForConditionalGeneration(config)


def _seq2seq(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    source = _padded_tokens(n, g, longest=40, shortest=6)
    target = _padded_tokens(n, g, longest=16, shortest=2)
    return {"input_ids": source["input_ids"], "attention_mask": source["attention_mask"],
            "labels": target["labels"]}


def hf_t5() -> Workload:
    """An HF T5 (encoder-decoder) on padded sources and padded labels."""
    return Workload(name="hf-t5-padded", model=_t5, batch=_seq2seq, loss=_hf_loss)


def has_peft() -> bool:
    return importlib.util.find_spec("peft") is not None


def _qwen2_lora() -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=PAD, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(Qwen2ForCausalLM(config), lora)


def peft_lora_qwen2() -> Workload:
    """A peft LoRA adapter (q and v projections) on an HF Qwen2, right-padded batches."""
    return Workload(name="peft-lora-qwen2", model=_qwen2_lora,
                    batch=functools.partial(_padded_tokens, longest=48, shortest=8), loss=_hf_loss)


class _PackedGRU(nn.Module):
    """A bidirectional GRU tagger over packed sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32, padding_idx=PAD)
        self.rnn = nn.GRU(32, 48, batch_first=True, bidirectional=True)
        self.head = nn.Linear(96, 8)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])
        return self.head(out)


def _tagged(n: int, g: torch.Generator, longest: int = 40) -> dict[str, torch.Tensor]:
    batch = _padded_tokens(n, g, longest=longest, shortest=4)
    lengths = batch["attention_mask"].sum(1)
    tags = torch.randint(0, 8, batch["input_ids"].shape, generator=g).masked_fill(batch["attention_mask"] == 0, -100)
    return {"ids": batch["input_ids"], "lengths": lengths, "tags": tags}


def packed_gru(longest: int = 40) -> Workload:
    """A bidirectional GRU over ``pack_padded_sequence`` (lengths as a CPU tensor), tag cross-entropy; sequences
    of 4 to ``longest`` tokens."""
    return Workload(name="packed-gru", model=_PackedGRU, batch=functools.partial(_tagged, longest=longest),
                    loss=lambda m, b: F.cross_entropy(m(b["ids"], b["lengths"]).flatten(0, 1), b["tags"].flatten(),
                                                      ignore_index=-100))


class _Speech(nn.Module):
    """A wav2vec2-style model: strided 1-D convolutions over a waveform, a transformer encoder, CTC logits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv1d(1, 32, 10, stride=5), nn.GELU(), nn.Conv1d(32, 32, 3, stride=2),
                                      nn.GELU(), nn.Conv1d(32, 32, 2, stride=2), nn.GELU())
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 30)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        x = self.features(audio.unsqueeze(1)).transpose(1, 2)
        return self.head(self.encoder(x)).log_softmax(-1)


def _frames(samples: torch.Tensor) -> torch.Tensor:
    """Output frames of :class:`_Speech`'s feature extractor for waveforms of ``samples`` samples."""
    for kernel, stride in ((10, 5), (3, 2), (2, 2)):
        samples = torch.div(samples - kernel, stride, rounding_mode="floor") + 1
    return samples


def _utterances(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    longest = 1600
    samples = torch.randint(longest // 2, longest + 1, (n,), generator=g)
    samples[0] = longest
    audio = torch.randn(n, longest, generator=g) * (torch.arange(longest) < samples.unsqueeze(1))
    target_lengths = torch.randint(5, 30, (n,), generator=g)
    targets = torch.randint(1, 30, (n, 30), generator=g)
    return {"audio": audio, "input_lengths": _frames(samples), "targets": targets, "target_lengths": target_lengths}


def _ctc_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    log_probs = model(b["audio"]).transpose(0, 1)  # (T, N, C)
    return F.ctc_loss(log_probs, b["targets"], b["input_lengths"], b["target_lengths"], zero_infinity=True)


def ctc() -> Workload:
    """A wav2vec2-style speech model trained with ``F.ctc_loss`` on tensor input and target lengths."""
    return Workload(name="ctc", model=_Speech, batch=_utterances, loss=_ctc_loss)


class _LateInteraction(nn.Module):
    """A ColBERT-style encoder: token embeddings for queries and documents."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 48)
        self.enc = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.enc(self.emb(ids)), dim=-1)


def _pairs(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(1, VOCAB, (n, 8), generator=g), torch.randint(1, VOCAB, (n, 24), generator=g)


def _in_batch_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    q, d = model(batch[0]), model(batch[1])                         # (B, Lq, D), (B, Ld, D)
    sim = torch.einsum("qid,pjd->qpij", q, d)                      # (B, B, Lq, Ld): every query x every doc
    scores = sim.amax(-1).sum(-1)                                  # late interaction: (B, B)
    return F.cross_entropy(scores / 0.05, torch.arange(q.shape[0], device=q.device))


def in_batch_negatives() -> Workload:
    """A late-interaction contrastive loss with in-batch negatives: memory partly quadratic in the batch."""
    return Workload(name="in-batch-negatives", model=_LateInteraction, batch=_pairs, loss=_in_batch_loss)


class _LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.rnn = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(ids))[0][:, -1])


def lstm() -> Workload:
    """A two-layer LSTM classifier over 24 tokens (the CPU runs it as oneDNN kernels)."""
    return Workload(name="lstm", model=_LSTMClassifier,
                    batch=lambda n, g: (torch.randint(1, VOCAB, (n, 24), generator=g),
                                        torch.randint(0, 10, (n,), generator=g)),
                    loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


#: name -> (builder, CPU memory budget in bytes, category of the issue it stands for)
CASES: dict[str, tuple] = {
    "hf-llama-padded": (hf_llama, 24 << 20, 1),
    "hf-gpt2-padded": (hf_gpt2, 24 << 20, 1),
    "hf-t5-padded": (hf_t5, 24 << 20, 1),
    "peft-lora-qwen2": (peft_lora_qwen2, 24 << 20, 1),
    "packed-gru": (packed_gru, 12 << 20, 2),
    "ctc": (ctc, 24 << 20, 2),
    "in-batch-negatives": (in_batch_negatives, 24 << 20, 3),
    "lstm": (lstm, 8 << 20, 4),
    "moe": (workloads.moe, 2 << 20, 5),
}
