"""The embedded default pair, shipped in the package under ``sfjax/default/``: a small Llama
target and a draft distilled from it, trained on the Python standard library's source by
``scripts/train_demo.py``, and an EAGLE-3 head for the target by ``scripts/train_eagle.py``
(each folder's README.md has the exact command and its results)."""

from __future__ import annotations

import os

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default")


def default_model_path() -> str:
    """The embedded target's HF folder."""
    return os.path.join(DEFAULT_DIR, "target")


def default_draft_path() -> str:
    """The embedded draft's HF folder (the target's tokenizer and vocabulary)."""
    return os.path.join(DEFAULT_DIR, "draft")


def default_eagle_path() -> str:
    """The EAGLE-3 head trained for the embedded target (``scripts/train_eagle.py``)."""
    return os.path.join(DEFAULT_DIR, "eagle3")


def default_ngram_table_path() -> str:
    """The embedded target's n-gram draft table (``speculative_config.prompt_lookup_table``),
    distilled from the target's greedy tokens on its training files."""
    return os.path.join(default_model_path(), "ngram_table.safetensors")


def default_speculative_config(method: str = "ngram") -> dict:
    """``speculative_config`` for the embedded target: ``"ngram"`` (the default of ``sfjax
    generate`` and ``sfjax serve``), prompt lookup of the last 3 tokens with the target's n-gram
    draft table, adaptive k (up to 7 drafts a round, each request's k from its own acceptance):
    on CPU at par with the best fixed k at T = 0 and well ahead of k = 3 at T = 0.8, where fixed
    drafts mostly fail (BENCHMARKS.md); ``"draft_model"``, the embedded draft, k = 4; or
    ``"eagle3"``, the embedded EAGLE-3 head, adaptive k."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": "auto", "prompt_lookup_min": 3,
                "prompt_lookup_max": 3, "prompt_lookup_table": default_ngram_table_path()}
    if method == "draft_model":
        return {"method": "draft_model", "model": default_draft_path(), "num_speculative_tokens": 4}
    if method == "eagle3":
        return {"method": "eagle3", "model": default_eagle_path(), "num_speculative_tokens": "auto"}
    raise ValueError(f"method: {method!r} is not 'ngram', 'draft_model' or 'eagle3'")
