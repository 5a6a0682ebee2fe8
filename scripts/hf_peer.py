"""The device check's peer: HF transformers' greedy ``generate`` on a Llama-2-7B-shaped random
bf16 model (``--smoke``: a tiny one), on the GPU when torch sees one.

    python scripts/hf_peer.py [--batches 1,32,128] [--prompt-len 128] [--max-tokens 128] [--smoke]

Prints one JSON line: per batch, the prefill and whole-run seconds and decode tok/s, measured as
``scripts/device_check.py`` measures sfjax (a warm-up run, then prefill (one new token) and the
whole run, each the best of ``--repeats``; decode tok/s = batch x (max_tokens - 1) / (whole -
prefill)). It imports no JAX, so the device check runs it in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def config(smoke: bool) -> LlamaConfig:
    shape = (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2) if smoke else
             dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32))
    return LlamaConfig(**shape, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       attn_implementation="sdpa")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    t = time.perf_counter()
    with torch.device(device):
        model = LlamaForCausalLM(config(args.smoke)).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "build_s": time.perf_counter() - t, "batches": {}}

    def run(x, n: int) -> float:
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            got = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        sync()
        assert got.shape[1] == x.shape[1] + n, "HF returned a wrong number of tokens"
        return time.perf_counter() - t

    vocab = model.config.vocab_size
    for b in map(int, args.batches.split(",")):
        x = torch.randint(2, vocab, (b, args.prompt_len), device=device,
                          generator=torch.Generator(device).manual_seed(b))
        warm = run(x, args.max_tokens)
        prefill = min(run(x, 1) for _ in range(args.repeats))
        total = min(run(x, args.max_tokens) for _ in range(args.repeats))
        out["batches"][b] = dict(warmup_s=warm, prefill_s=prefill, total_s=total,
                                 decode_tok_s=b * (args.max_tokens - 1) / (total - prefill))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
