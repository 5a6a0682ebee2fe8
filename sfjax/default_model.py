"""The embedded default model: until a trained pair ships, a small random Llama and a BPE
tokenizer built deterministically (seed 0) into a cache folder on first use."""

from __future__ import annotations

import os
import shutil
import tempfile

from sfjax import toy

VERSION = "random-v1"


def default_model_path() -> str:
    root = os.environ.get("SFJAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "sfjax"))
    path = os.path.join(root, f"default-{VERSION}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root)
    cfg = toy.tiny_config(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=8,
                          num_kv_heads=4, head_dim=16)
    toy.build_model_folder(tmp, cfg, seed=0, std=0.05)
    try:
        os.rename(tmp, path)
    except OSError:              # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path
