"""Trains an EAGLE-3 head for the embedded demo target, on CPU, from a seed.

    nice -n 19 python scripts/train_eagle.py --out sfjax/default/eagle3 --ckpt-dir /tmp/sfjax-eagle
    python scripts/train_eagle.py --smoke --out /tmp/eagle --ckpt-dir /tmp/eagle-ckpt   # seconds

1. Corpus: train_demo.py's (the standard library's .py files, every 20th held out), in the
   target's own tokenizer, packed into sequences of the target's context length.
2. The head (``sfjax.spec.eagle``): one Llama layer of the target's width fusing the input of
   target layers 1, 2 and 3 (low, middle, high), over a draft vocabulary of the corpus's most
   frequent target ids, sharing the target's embedding.
3. Trained on the target's own distributions (``sfjax.spec.eagle_train``: soft labels, AdamW
   with warmup and cosine decay) with EAGLE-3's training-time test: the head also learns from its
   own outputs at depths 1 .. DEPTH - 1, as it drafts in the round. Training state (a flax
   ``TrainState``) is checkpointed with orbax under --ckpt-dir and restored from there when the
   script runs again: a rerun resumes, and gives the same head as an uninterrupted run.
4. Held-out greedy agreement with the target per draft position (the acceptance rate of a
   greedy draft at that position, given the earlier ones were accepted), written to the folder's
   README.md with the command that made it. The folder holds bfloat16 tensors; loaders cast
   them to the target's dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tokenizers import Tokenizer
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_demo  # noqa: E402

from sfjax import weights as W  # noqa: E402
from sfjax.config import ModelConfig  # noqa: E402
from sfjax.default_model import default_model_path  # noqa: E402
from sfjax.spec import eagle, eagle_train  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Run:
    draft_vocab: int
    intermediate: int
    aux_layers: tuple[int, int, int]
    seq_len: int
    batch_size: int
    steps: int
    depth: int
    lr: float
    eval_seqs: int
    ckpt_every: int
    max_files: int | None = None
    seed: int = 0


FULL = Run(draft_vocab=2048, intermediate=640, aux_layers=(1, 2, 3), seq_len=128, batch_size=8,
           steps=500, depth=3, lr=3e-3, eval_seqs=64, ckpt_every=50)
SMOKE = Run(draft_vocab=512, intermediate=128, aux_layers=(1, 2, 3), seq_len=64, batch_size=2,
            steps=6, depth=2, lr=3e-3, eval_seqs=2, ckpt_every=3, max_files=30)


def head_config(target: ModelConfig, run: Run) -> eagle.HeadConfig:
    layer = dataclasses.replace(target, num_layers=1, intermediate_size=run.intermediate)
    return eagle.HeadConfig(layer=layer, draft_vocab_size=run.draft_vocab,
                            target_hidden_size=target.hidden_size, aux_layers=run.aux_layers)


def draft_ids(seqs: np.ndarray, vocab: int, n: int) -> np.ndarray:
    """The ``n`` most frequent ids of the corpus (ties: the lower id), sorted."""
    counts = np.bincount(seqs.reshape(-1), minlength=vocab)
    return np.sort(np.lexsort((np.arange(vocab), -counts))[:n]).astype(np.int32)


def held_out_agreement(state, frozen, target, cfg, hc, seqs, run: Run) -> list[float]:
    """Greedy agreement with the target at each draft position over ``seqs``."""
    sums, n = np.zeros(run.depth), 0
    for i in range(0, len(seqs), run.batch_size):
        x = seqs[i:i + run.batch_size]
        if len(x) < run.batch_size:
            break
        _, (_, acc) = eagle_train.evaluate(state.params, frozen, target, jnp.asarray(x), hc, cfg,
                                           run.depth)
        sums, n = sums + np.asarray(acc, np.float64), n + 1
    return (sums / max(n, 1)).tolist()


def card(hc: eagle.HeadConfig, run: Run, metrics: dict, command: str) -> str:
    per = metrics["held_out_agreement_per_position"]
    chain = np.cumprod(per)
    return (
        "# sfjax demo EAGLE-3 head\n\n"
        f"An EAGLE-3 head for the demo target (`../target`): one Llama layer (d "
        f"{hc.layer.hidden_size}, FFN {hc.layer.intermediate_size}) fusing the input of target "
        f"layers {list(hc.aux_layers)}, drafting over the {hc.draft_vocab_size} most frequent "
        f"ids of the corpus (`d2t` / `t2d`), sharing the target's embedding; trained on CPU on the "
        f"target's own distributions with the training-time test to depth {run.depth}.\n\n"
        f"Made by (seed {run.seed}):\n\n    {command}\n\n"
        "Held-out greedy agreement with the target per draft position (given the earlier drafts "
        "were accepted), and the chance that the first j drafts are all accepted:\n\n"
        + "".join(f"- position {j + 1}: {p:.3f} (first {j + 1}: {c:.3f})\n"
                  for j, (p, c) in enumerate(zip(per, chain)))
        + "".join(f"- {k}: {v}\n" for k, v in metrics.items()
                  if k != "held_out_agreement_per_position"))


def _digest(weights) -> str:
    """The target's weights' digest (a resume refuses a target rebuilt at the same path)."""
    h = hashlib.sha256()
    for x in jax.tree.leaves(weights):
        h.update(np.asarray(x).tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the head's folder (written)")
    parser.add_argument("--ckpt-dir", required=True, help="orbax checkpoints; a rerun resumes")
    parser.add_argument("--target", default=None, help="the target folder (default: the demo's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny run of a few seconds")
    parser.add_argument("--steps", type=int, default=None, help="override the run's steps")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps} must be >= 1")
    run = dataclasses.replace(SMOKE if args.smoke else FULL, seed=args.seed)
    if args.steps is not None:
        run = dataclasses.replace(run, steps=args.steps)
    command = "python " + shlex.join(["scripts/train_eagle.py",
                                      *(argv if argv is not None else sys.argv[1:])])
    t0 = time.perf_counter()
    target_path = args.target or default_model_path()
    cfg = ModelConfig.from_folder(target_path)
    if args.smoke:                 # a small layer stack: the smoke run trains on the first layers
        run = dataclasses.replace(run, aux_layers=(0, cfg.num_layers // 2, cfg.num_layers - 1))
    target = jax.tree.map(jnp.asarray, W.load_hf(target_path, cfg))
    tok = Tokenizer.from_file(os.path.join(target_path, "tokenizer.json"))

    os.makedirs(args.ckpt_dir, exist_ok=True)
    run_file = os.path.join(args.ckpt_dir, "run.json")
    desc = json.dumps({**dataclasses.asdict(run), "target": os.path.abspath(target_path),
                       "target_weights": _digest(target)}, sort_keys=True, default=str)
    if os.path.exists(run_file) and open(run_file).read() != desc:
        raise SystemExit(f"{args.ckpt_dir} holds checkpoints of a different run; use another --ckpt-dir")
    with open(run_file, "w") as f:
        f.write(desc)

    root, files = train_demo.corpus_files(run.max_files)
    held = [f for i, f in enumerate(files) if i % train_demo.HELD_OUT_EVERY == 0]
    train_files = [f for i, f in enumerate(files) if i % train_demo.HELD_OUT_EVERY]
    seq_len = min(run.seq_len, cfg.context[0])
    seqs = train_demo.pack(tok, train_demo.read_texts(root, train_files), seq_len - 1)
    held_out = train_demo.pack(tok, train_demo.read_texts(root, held), seq_len - 1)[:run.eval_seqs]
    hc = head_config(cfg, run)
    init = eagle.init_random(hc, seed=run.seed,
                             draft_ids=draft_ids(seqs, cfg.vocab_size, run.draft_vocab))
    state, frozen = eagle_train.init_state(init, target.embed, run.lr, run.steps)
    state = jax.device_put(state.replace(step=np.int32(0)), jax.devices()[0])
    order = train_demo.batch_order(len(seqs), run.steps, run.batch_size, run.seed)
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=run.ckpt_every)
    with ocp.CheckpointManager(os.path.join(os.path.abspath(args.ckpt_dir), "head"),
                               options=options) as mgr:
        state = train_demo.restore(mgr, state, args.ckpt_dir)
        start = int(state.step)
        bar = tqdm(range(start, run.steps), desc="EAGLE-3 head", initial=start, total=run.steps,
                   dynamic_ncols=True)
        for step in bar:
            state, (ce, acc) = eagle_train.train_step(state, frozen, target,
                                                      jnp.asarray(seqs[order[step]]), hc, cfg,
                                                      run.depth)
            bar.set_postfix(ce=f"{float(ce[0]):.3f}", agree=f"{float(acc[0]):.3f}")
            mgr.save(step + 1, args=ocp.args.StandardSave(state), force=step + 1 == run.steps)
        bar.close()
        mgr.wait_until_finished()
    metrics = {"held_out_agreement_per_position":
               held_out_agreement(state, frozen, target, cfg, hc, held_out, run),
               "training_sequences": len(seqs), "held_out_sequences": len(held_out),
               "wall_seconds": round(time.perf_counter() - t0)}
    head = eagle_train.head_of(state, frozen)      # bfloat16 tensors, as the demo pair's
    floats = {f.name: getattr(head, f.name).astype(jnp.bfloat16) for f in dataclasses.fields(head)
              if f.name not in eagle_train.FROZEN}
    eagle.save(args.out, hc, dataclasses.replace(head, **floats))
    os.chmod(os.path.join(args.out, "model.safetensors"), 0o644)   # safetensors writes it 0600
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(card(hc, run, metrics, command))
    print(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
