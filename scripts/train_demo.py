"""Trains the embedded demo pair on the Python standard library's source, on CPU, from a seed.

    nice -n 19 python scripts/train_demo.py --out sfjax/default --ckpt-dir /tmp/sfjax-train
    python scripts/train_demo.py --smoke --out /tmp/demo --ckpt-dir /tmp/demo-ckpt   # seconds

1. Corpus: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` except site-packages,
   test suites, encodings tables and pydoc_data, sorted; every 20th file is held out.
2. A byte-level BPE (``tokenizers``) trained on the training files; ``<s>`` = 0 and ``</s>`` = 1
   wrap each file, and the files are packed into sequences of ``seq_len + 1`` tokens.
3. The target Llama, trained on next-token cross-entropy (optax AdamW, warmup + cosine).
4. The draft, a smaller Llama distilled from the target: KL(target || draft) over the vocabulary.
5. Held-out loss of both, and the draft's greedy agreement with the target on held-out text
   (the expected acceptance rate of one greedy draft token), written to the folders' README.md.
6. The n-gram draft table (``sfjax.spec.table``), the prompt-lookup proposer's fallback, as
   ``target/ngram_table.safetensors``: the shipped target's greedy next token at each position of
   every 8th training sequence, counted by context (the last token, the last two), chained 4 tokens
   deep. ``--table-only`` rebuilds just this from the folder's target and tokenizer (a minute).

The forward is the dense causal Llama over sfjax's ``Weights`` pytree (``sfjax.training``), so
the trained arrays go straight to ``weights.save_hf``; ``tests/test_demo_model.py``
checks HF transformers against sfjax on the shipped folders. Training state (a flax
``TrainState``: step, weights, optimizer state) is checkpointed with orbax under --ckpt-dir and
restored from there when the script runs again. The folders hold bfloat16 tensors and a float32
``config.json``: loaders upcast, and serve the model in float32 (XLA:CPU's fastest).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training.train_state import TrainState
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from sfjax import toy
from sfjax import weights as W
from sfjax.config import ModelConfig
from sfjax.training import forward
from sfjax.spec import table as ngram_table

EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"}
HELD_OUT_EVERY = 20
NGRAM_WIDTH, NGRAM_MIN_COUNT = 4, 2      # the table's continuation length; a bigram's min. count
NGRAM_EVERY = 8                          # the table counts every 8th training sequence


@dataclasses.dataclass(frozen=True)
class Run:
    vocab_size: int
    seq_len: int
    target: ModelConfig
    draft: ModelConfig
    batch_size: int
    target_steps: int
    draft_steps: int
    lr: float
    eval_seqs: int
    ckpt_every: int
    max_files: int | None = None     # the first N corpus files only (smoke runs)
    seed: int = 0


def llama(vocab: int, seq_len: int, d: int, layers: int, heads: int, kv_heads: int, ffn: int):
    return ModelConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ffn, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=d // heads,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=seq_len,
                       bos_token_id=0, eos_token_ids=(1,))


FULL = Run(vocab_size=4096, seq_len=256,
           target=llama(4096, 256, d=256, layers=4, heads=4, kv_heads=2, ffn=640),
           draft=llama(4096, 256, d=128, layers=2, heads=2, kv_heads=1, ffn=384),
           batch_size=8, target_steps=800, draft_steps=400, lr=3e-3, eval_seqs=64, ckpt_every=50)
SMOKE = Run(vocab_size=384, seq_len=64,
            target=llama(384, 64, d=64, layers=2, heads=4, kv_heads=2, ffn=128),
            draft=llama(384, 64, d=32, layers=1, heads=2, kv_heads=1, ffn=64),
            batch_size=4, target_steps=6, draft_steps=4, lr=3e-3, eval_seqs=4, ckpt_every=3,
            max_files=30)


# ---------------------------------------------------------------------------------------------
# data


def corpus_files(max_files: int | None) -> tuple[str, list[str]]:
    """(stdlib root, sorted relative paths of its .py files outside EXCLUDED_DIRS)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel = os.path.relpath(dirpath, root)
        files += [os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".py")]
    return root, sorted(files)[:max_files]


def read_texts(root: str, files: list[str]) -> list[str]:
    texts = []
    for f in files:
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    return texts


def pack(tok: Tokenizer, texts: list[str], seq_len: int) -> np.ndarray:
    """int32 [n, seq_len + 1]: the files as ``<s> ... </s>``, concatenated and cut."""
    stream = np.concatenate([np.array(e.ids + [1], np.int32) for e in tok.encode_batch(texts)])
    n = len(stream) // (seq_len + 1)
    return stream[:n * (seq_len + 1)].reshape(n, seq_len + 1)


def batch_order(n_seqs: int, steps: int, batch: int, seed: int) -> np.ndarray:
    """Sequence indices [steps, batch]: seeded permutations, one per epoch, end to end."""
    rng = np.random.default_rng(seed)
    epochs = -(-steps * batch // n_seqs)
    return np.concatenate([rng.permutation(n_seqs) for _ in range(epochs)])[:steps * batch].reshape(
        steps, batch)


# ---------------------------------------------------------------------------------------------
# model and losses


def loss_fn(w, seqs, cfg: ModelConfig, teacher=None, teacher_cfg: ModelConfig | None = None):
    """Next-token cross-entropy; with a ``teacher`` (weights held fixed), the mean over positions
    of KL(teacher || model) instead: distillation."""
    logits = forward(w, seqs[:, :-1], cfg)
    if teacher is None:
        return optax.softmax_cross_entropy_with_integer_labels(logits, seqs[:, 1:]).mean()
    p_log = jax.nn.log_softmax(forward(teacher, seqs[:, :-1], teacher_cfg))
    return (jnp.exp(p_log) * (p_log - jax.nn.log_softmax(logits))).sum(-1).mean()


@functools.partial(jax.jit, static_argnames=("cfg", "teacher_cfg"), donate_argnames=("state",))
def train_step(state: TrainState, seqs, teacher, cfg, teacher_cfg):
    """One AdamW step on ``loss_fn``; donates ``state``."""
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(p["weights"], seqs, cfg, teacher, teacher_cfg))(state.params)
    return state.apply_gradients(grads=grads), loss


@functools.partial(jax.jit, static_argnames=("target_cfg", "draft_cfg"))
def eval_batch(target_w, draft_w, seqs, target_cfg, draft_cfg):
    """Summed target CE, draft CE and draft == target greedy agreements over ``seqs``."""
    tl = forward(target_w, seqs[:, :-1], target_cfg)
    dl = forward(draft_w, seqs[:, :-1], draft_cfg)
    ce = optax.softmax_cross_entropy_with_integer_labels
    return (ce(tl, seqs[:, 1:]).sum(), ce(dl, seqs[:, 1:]).sum(),
            (tl.argmax(-1) == dl.argmax(-1)).sum())


def evaluate(target_w, draft_w, seqs, run: Run, split: str) -> dict[str, float]:
    sums = np.zeros(3)
    for i in range(0, len(seqs), run.batch_size):
        sums += np.asarray(eval_batch(target_w, draft_w, seqs[i:i + run.batch_size],
                                      run.target, run.draft), np.float64)
    n = seqs[:, 1:].size
    return {f"target_{split}_loss": sums[0] / n, f"draft_{split}_loss": sums[1] / n,
            f"draft_greedy_agreement_{split}": sums[2] / n}


# ---------------------------------------------------------------------------------------------
# training with orbax checkpoints


def decay_mask(params: dict) -> dict:
    """AdamW's weight decay on the matrices, not on the norms."""
    w = params["weights"]
    return {"weights": W.Weights(**{f.name: None if getattr(w, f.name) is None
                                    else "norm" not in f.name for f in dataclasses.fields(w)})}


@functools.lru_cache
def optimizer(lr: float, steps: int) -> optax.GradientTransformation:
    """AdamW with warmup and cosine decay; cached, so equal runs in one process share the
    TrainState's treedef (``tx`` is static in it) and hence train_step's compilation."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 20, 1), steps,
                                                  end_value=lr / 10)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask))


def restore(mgr, state, ckpt_dir: str):
    """``state`` from the manager's latest checkpoint (as it is, if there is none); a checkpoint
    that cannot be restored (damaged, cut short, another model's, or memory running out) is one
    error naming the folder and the step."""
    step = mgr.latest_step()
    if step is None:
        return state
    try:
        return mgr.restore(step, args=ocp.args.StandardRestore(state))
    except Exception as e:       # orbax's and tensorstore's own errors
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise SystemExit(f"--ckpt-dir {ckpt_dir}: step {step} under {mgr.directory} cannot be "
                         f"restored ({why}); if it is damaged or another run's, delete it or "
                         f"use another --ckpt-dir") from None


def train(name: str, cfg: ModelConfig, seqs: np.ndarray, steps: int, run: Run, ckpt_dir: str,
          seed: int, teacher: W.Weights | None = None, teacher_cfg: ModelConfig | None = None
          ) -> W.Weights:
    """Trains from the latest checkpoint in ``ckpt_dir/name`` (or from init) to ``steps``."""
    state = TrainState.create(apply_fn=forward, params={"weights": W.init_random(cfg, seed, std=0.02)},
                              tx=optimizer(run.lr, steps))
    # a committed state with a typed step, as orbax restores it, so a resumed run reuses the compile
    state = jax.device_put(state.replace(step=np.int32(0)), jax.devices()[0])
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=run.ckpt_every)
    with ocp.CheckpointManager(os.path.join(os.path.abspath(ckpt_dir), name), options=options) as mgr:
        state = restore(mgr, state, ckpt_dir)
        order = batch_order(len(seqs), steps, run.batch_size, seed)
        start = int(state.step)
        bar = tqdm(range(start, steps), desc=f"{name} ({cfg.num_params() / 1e6:.2f}M params)",
                   initial=start, total=steps, dynamic_ncols=True)
        for step in bar:
            state, loss = train_step(state, seqs[order[step]], teacher, cfg, teacher_cfg)
            bar.set_postfix(loss=f"{float(loss):.3f}")
            mgr.save(step + 1, args=ocp.args.StandardSave(state), force=step + 1 == steps)
        bar.close()
        mgr.wait_until_finished()
    return state.params["weights"]


def save_folder(path: str, cfg: ModelConfig, w: W.Weights, tok: Tokenizer, card: str) -> None:
    """An HF folder: bfloat16 safetensors under a float32 config.json, tokenizer, generation config."""
    W.save_hf(path, cfg, jax.tree.map(lambda x: x.astype(jnp.bfloat16), w))
    toy.save_tokenizer(path, tok)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}, f,
                  indent=2)
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(card)
    os.chmod(os.path.join(path, "model.safetensors"), 0o644)   # safetensors writes it 0600


def write_ngram_table(target: str, seqs: np.ndarray, batch: int = 32) -> None:
    """The n-gram draft table of the target folder's model, in ``target``: its greedy next token
    at each position of every ``NGRAM_EVERY``-th sequence of ``seqs`` (the weights as shipped,
    served in float32), counted by ``sfjax.spec.table.build``."""
    cfg = ModelConfig.from_folder(target)
    w = W.load_hf(target, cfg)
    seqs = seqs[::NGRAM_EVERY]
    greedy = jax.jit(lambda w, x: jnp.argmax(forward(w, x, cfg), axis=-1).astype(jnp.int32))
    preds = np.zeros_like(seqs)
    for i in tqdm(range(0, len(seqs), batch), desc="n-gram table", unit="batch"):
        x = seqs[i:i + batch]
        pad = np.zeros((batch - len(x), seqs.shape[1]), seqs.dtype)    # one compiled shape
        preds[i:i + batch] = np.asarray(greedy(w, np.concatenate([x, pad])))[:len(x)]
    t = ngram_table.build(seqs, cfg.vocab_size, NGRAM_WIDTH, NGRAM_MIN_COUNT, predictions=preds)
    path = os.path.join(target, ngram_table.TABLE_FILE)
    ngram_table.save(t, path)
    print(f"n-gram table: {t.keys.shape[0]} two-token contexts, {cfg.vocab_size} tokens -> {path}")


TABLE_CARD = (
    "`ngram_table.safetensors`: this model's n-gram draft table (prompt lookup's fallback,\n"
    "`speculative_config.prompt_lookup_table`): its own greedy next tokens on every 8th training\n"
    "sequence, by context, chained 4 deep. The same script writes it, and `--table-only` rewrites\n"
    "just it (a minute).\n\n")


def model_card(role: str, cfg: ModelConfig, run: Run, metrics: dict, command: str) -> str:
    return (
        f"# sfjax demo {role}\n\n"
        f"A {cfg.num_params() / 1e6:.2f}M-parameter Llama ({cfg.num_layers} layers, d {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, vocabulary {cfg.vocab_size}, "
        f"context {cfg.max_position_embeddings}) trained on CPU on the .py files of Python "
        f"{sys.version.split()[0]}'s standard library; bfloat16 tensors, served in float32.\n\n"
        f"Made by (seed {run.seed}):\n\n    {command}\n\n"
        + (TABLE_CARD if role == "target" else "")
        + "".join(f"- {k}: {v:.4g}\n" if isinstance(v, float) else f"- {k}: {v}\n"
                  for k, v in metrics.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="writes OUT/target and OUT/draft (HF folders)")
    parser.add_argument("--ckpt-dir", required=True,
                        help="orbax checkpoints and the tokenizer; a rerun resumes from here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny run of a few seconds")
    parser.add_argument("--table-only", action="store_true",
                        help="only (re)write OUT/target's n-gram table, from OUT/target's model "
                             "and tokenizer")
    args = parser.parse_args(argv)
    run = dataclasses.replace(SMOKE if args.smoke else FULL, seed=args.seed)
    if args.table_only:
        target = os.path.join(args.out, "target")
        cfg = ModelConfig.from_folder(target)
        if (cfg.vocab_size, cfg.max_position_embeddings) != (run.vocab_size, run.seq_len):
            raise SystemExit(
                f"--table-only: {target} (vocabulary {cfg.vocab_size}, context "
                f"{cfg.max_position_embeddings}) is not what this run trains (vocabulary "
                f"{run.vocab_size}, context {run.seq_len}): "
                f"{'drop' if args.smoke else 'add'} --smoke")
        root, files = corpus_files(run.max_files)
        texts = read_texts(root, [f for i, f in enumerate(files) if i % HELD_OUT_EVERY])
        tok = Tokenizer.from_file(os.path.join(target, "tokenizer.json"))
        write_ngram_table(target, pack(tok, texts, run.seq_len))
        return 0
    command = "python " + shlex.join(["scripts/train_demo.py", *(argv if argv is not None else sys.argv[1:])])
    t0 = time.perf_counter()

    os.makedirs(args.ckpt_dir, exist_ok=True)
    run_file = os.path.join(args.ckpt_dir, "run.json")
    run_desc = json.dumps(dataclasses.asdict(run), sort_keys=True, default=str)
    if os.path.exists(run_file) and open(run_file).read() != run_desc:
        raise SystemExit(f"{args.ckpt_dir} holds checkpoints of a different run; use another --ckpt-dir")
    with open(run_file, "w") as f:
        f.write(run_desc)

    root, files = corpus_files(run.max_files)
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0]
    train_files = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY]
    train_texts, held_texts = read_texts(root, train_files), read_texts(root, held)
    tok_file = os.path.join(args.ckpt_dir, "tokenizer.json")
    if os.path.exists(tok_file):
        tok = Tokenizer.from_file(tok_file)
    else:
        tok = toy.build_tokenizer(run.vocab_size, train_texts)
        tok.save(tok_file)
    seqs, held_out = pack(tok, train_texts, run.seq_len), pack(tok, held_texts, run.seq_len)
    held_out = held_out[:run.eval_seqs]
    print(f"corpus: {len(train_files)} training files ({seqs.size} tokens), {len(held)} held out "
          f"({held_out.size} tokens evaluated); tokenizer {time.perf_counter() - t0:.1f} s")

    target_w = train("target", run.target, seqs, run.target_steps, run, args.ckpt_dir, run.seed)
    draft_w = train("draft", run.draft, seqs, run.draft_steps, run, args.ckpt_dir, run.seed + 1,
                    teacher=target_w, teacher_cfg=run.target)
    metrics = {**evaluate(target_w, draft_w, seqs[:run.eval_seqs], run, "train"),
               **evaluate(target_w, draft_w, held_out, run, "held_out"),
               "training_files": len(train_files), "held_out_files": len(held),
               "wall_seconds": round(time.perf_counter() - t0)}
    for role, cfg, w in (("target", run.target, target_w), ("draft", run.draft, draft_w)):
        save_folder(os.path.join(args.out, role), cfg, w, tok,
                    model_card(role, cfg, run, metrics, command))
    write_ngram_table(os.path.join(args.out, "target"), seqs)
    print(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
