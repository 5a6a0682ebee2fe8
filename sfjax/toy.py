"""Small HF-format model folders built deterministically from a seed, with no hub and no torch.

Tests build their models here (the embedded default pair is trained: scripts/train_demo.py).
A folder holds config.json, generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json, exactly what HF transformers and sfjax load.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from sfjax import weights as W
from sfjax.config import ModelConfig

BOS, EOS = "<s>", "</s>"

# A fixed corpus so the tokenizer is the same on every machine and Python version.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks.
Speculative decoding drafts tokens with a small model and verifies them with a large one.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for i in range(10):
    print(i, fibonacci(i))
class Cache:
    def __init__(self, size):
        self.size = size
        self.items = {}
Once upon a time there was a little model that wanted to write exact programs.
It read every token, counted every block, and never lost a request.
import jax
import jax.numpy as jnp
x = jnp.ones((4, 4))
y = jax.jit(lambda a: a @ a)(x)
"""


def build_tokenizer(vocab_size: int = 512, texts: list[str] | None = None) -> Tokenizer:
    """A byte-level BPE trained on ``texts`` (default: CORPUS) with ``<s>`` = 0 and ``</s>`` = 1;
    a BOS is prepended on encode."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts or [CORPUS] * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0), (EOS, 1)])
    return tok


def build_sentencepiece_tokenizer(vocab_size: int = 512, texts: list[str] | None = None) -> Tokenizer:
    """A Llama-2-style tokenizer trained on ``texts`` (default: CORPUS): "▁" for a space (one
    prepended to the text), <0x00>..<0xFF> (ids 2..257) for bytes no merge covers, ``<s>`` = 0
    and ``</s>`` = 1, a BOS prepended on encode; its decoder strips the text's leading space."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                 split=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=[BOS, EOS],
                                  show_progress=False)
    tok.train_from_iterator(texts or [CORPUS] * 4, trainer)
    spec = json.loads(tok.to_str())
    vocab = {BOS: 0, EOS: 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    spec["model"]["vocab"] = vocab
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0), (EOS, 1)])
    return tok


def save_tokenizer(path: str, tok: Tokenizer) -> None:
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                   "clean_up_tokenization_spaces": False, "add_bos_token": False,
                   "model_max_length": 1 << 20}, f, indent=2)


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                max_position_embeddings=1024, bos_token_id=0, eos_token_ids=(1,))
    base.update(overrides)
    return ModelConfig(**base)


def llama_68m_config(**overrides) -> ModelConfig:
    """The shape of aphrodite's llama-68m test model (JackFram/llama-68m)."""
    return dataclasses.replace(tiny_config(
        vocab_size=32000, hidden_size=768, intermediate_size=3072, num_layers=2, num_heads=12,
        num_kv_heads=12, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6), **overrides)


def llama_160m_config(**overrides) -> ModelConfig:
    """The shape of aphrodite's llama-160m test model (JackFram/llama-160m)."""
    return llama_68m_config(num_layers=12, **overrides)


def build_model_folder(path: str, cfg: ModelConfig, seed: int = 0, std: float = 0.02,
                       norm_jitter: float = 0.0, max_shard_bytes: int | None = None,
                       weights: W.Weights | None = None, tokenizer: str = "byte_level") -> str:
    """Writes a complete HF folder for ``cfg`` with random weights from ``seed``; returns ``path``.
    ``tokenizer``: "byte_level" (``build_tokenizer``) or "sentencepiece"
    (``build_sentencepiece_tokenizer``)."""
    os.makedirs(path, exist_ok=True)
    if weights is None:
        weights = W.init_random(cfg, seed, std=std, norm_jitter=norm_jitter)
    W.save_hf(path, cfg, weights, max_shard_bytes=max_shard_bytes)
    build = {"byte_level": build_tokenizer, "sentencepiece": build_sentencepiece_tokenizer}
    save_tokenizer(path, build[tokenizer](min(cfg.vocab_size, 512)))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    return path
