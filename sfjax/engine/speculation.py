"""The host side of speculative decoding: per-row k, the step's rows (verify and draft rows too)
laid out by data shard, and reading a round back (emitted tokens, rollback by length, metrics)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from sfjax import sharding
from sfjax.cache import KVCache
from sfjax.config import ModelConfig
from sfjax.engine.scheduler import Request, Scheduled
from sfjax.spec import table
from sfjax.spec.config import SpeculativeConfig
from sfjax.spec.registry import Registry, Strategy
from sfjax.spec.round import RoundConfig, SpecBatch
from sfjax.weights import Weights


@dataclasses.dataclass
class SpecMetrics:
    """vLLM's spec-decode counters (vllm:spec_decode_num_*)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def add(self, k: int, accepted: int) -> None:
        if k <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos += [0] * (k - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per drafting round: accepted drafts plus the target's token."""
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length}


class Speculator:
    """The engine's speculation: config, the draft model and its cache, and the certificate."""

    def __init__(self, config: SpeculativeConfig, cfg: ModelConfig, max_model_len: int,
                 num_blocks: int, block_size: int, draft: tuple[ModelConfig, Weights] | None = None,
                 registry: Registry | None = None, mesh=None, split: bool = False, tiles=None):
        """``tiles``: (cfg, placed weights) -> cfg with its certified small row tiles (the
        engine's ``rows.with_certified_tiles``), for the draft."""
        self.config = config
        self.k_max = config.num_speculative_tokens
        self.draft_cfg, self.draft_weights = draft if draft else (None, None)
        if config.method == "draft_model":
            if draft is None:
                raise ValueError("speculative_config.model: the draft model was not loaded")
            if self.draft_cfg.vocab_size != cfg.vocab_size:
                raise ValueError(f"speculative_config.model: the draft's vocabulary "
                                 f"({self.draft_cfg.vocab_size}) differs from the target's ({cfg.vocab_size})")
        limit = config.max_model_len
        if limit is not None and limit > max_model_len:
            raise ValueError(f"speculative_config.max_model_len ({limit}) must be <= the target's "
                             f"max_model_len ({max_model_len})")
        self.max_model_len = limit or max_model_len
        if self.draft_cfg is not None:
            self.max_model_len = min(self.max_model_len, self.draft_cfg.max_position_embeddings)
        self.round = RoundConfig(method=config.method, acceptance=config.acceptance_method,
                                 k_max=self.k_max, ngram_min=config.prompt_lookup_min,
                                 ngram_max=config.prompt_lookup_max,
                                 threshold=config.posterior_threshold, alpha=config.posterior_alpha)
        self.registry = registry or Registry()
        self.slot = self.registry.register(Strategy(config.method, config.acceptance_method))
        self.certificate = self.registry.slots[self.slot]
        self.mesh = None
        if self.draft_cfg is not None and mesh is not None:
            self.mesh = sharding.draft_mesh(mesh, config.draft_tensor_parallel_size
                                            or sharding.tp_of(mesh))
            sharding.validate(self.draft_cfg, self.mesh, "draft")
        if self.draft_cfg is not None:
            self.draft_weights = sharding.place_weights(self.draft_weights, self.draft_cfg, self.mesh,
                                                     split)
            if tiles is not None and self.mesh is None:
                self.draft_cfg = tiles(self.draft_cfg, self.draft_weights)
        if config.prompt_lookup_table is not None:      # the n-gram table rides as "draft weights"
            t = table.load(config.prompt_lookup_table, cfg.vocab_size)
            self.draft_weights = t if mesh is None else sharding.put(
                t, jax.tree.map(lambda _: P(), t), mesh)
        self.draft_cache = (KVCache.zeros(self.draft_cfg, num_blocks, block_size, mesh=self.mesh)
                            if self.draft_cfg is not None else None)
        self.metrics = SpecMetrics()

    def enabled_for_step(self, num_running: int) -> bool:
        n = self.config.disable_by_batch_size
        return n is None or num_running < n

    def k_for(self, req: Request, budget: int) -> int:
        """Drafts for this row this round: 0 if it opted out, is past the draft's max_model_len,
        or has at most one token left to emit."""
        length = req.num_tokens
        if req.strategy_slot != self.slot:
            return 0
        k = min(self.k_max, budget - 1)
        if length + k > self.max_model_len:
            return 0
        return max(k, 0)


def layout(plan: list[Scheduled], spec_k: dict[int, int], k_max: int) -> list[tuple]:
    """Each entry's rows of the step as (tokens, positions, slots) lists: its tokens, or K + 1
    verify rows ``[last token, 0 x K]`` at L-1 .. L-1+K for a speculating decode entry."""
    out = []
    for i, s in enumerate(plan):
        req = s.request
        if i in spec_k:
            length = req.num_tokens
            out.append(([req.token(length - 1)] + [0] * k_max,
                        list(range(length - 1, length + k_max)), [req.slot] * (k_max + 1)))
        else:
            out.append(([req.token(j) for j in range(s.start, s.start + s.count)],
                        list(range(s.start, s.start + s.count)), [req.slot] * s.count))
    return out


def draft_rows(plan: list[Scheduled], decode: set[int]) -> list[tuple]:
    """The draft model's first pass, per entry as ``layout``: prefill rows as the target's,
    (L-2, L-1) per decode entry (speculating or not, so its cache stays current)."""
    out = []
    for i, s in enumerate(plan):
        req = s.request
        if i in decode:
            length = req.num_tokens
            out.append(([req.token(length - 2), req.token(length - 1)], [length - 2, length - 1],
                        [req.slot] * 2))
        else:
            out.append(([req.token(j) for j in range(s.start, s.start + s.count)],
                        list(range(s.start, s.start + s.count)), [req.slot] * s.count))
    return out


def bucket(n: int, tile: int) -> int:
    """Smallest tile * 2**j >= n: few shapes, so few compilations."""
    b = tile
    while b < n:
        b *= 2
    return b


def pack(entries: list[tuple], shards: list[int], num_shards: int, tile: int, min_rows: int = 0):
    """The step's rows laid out by data shard (``sfjax.sharding``): each entry's rows (``layout``)
    go to its shard's segment in order, and every segment is padded to one length, the busiest
    shard's bucketed (at least ``min_rows / num_shards``): the shapes stay a small fixed set. With
    one shard, the entries' rows in order, padded to a bucket of at least ``min_rows``.

    Returns (tokens, positions, slots int32 [num_shards * segment], first row of each entry).
    """
    load, offset = [0] * num_shards, []
    for (rows, _, _), d in zip(entries, shards):
        offset.append(load[d])
        load[d] += len(rows)
    seg = bucket(max(max(load), -(-min_rows // num_shards), 1), tile)
    n = num_shards * seg
    tokens, positions, slots = (np.full(n, fill, np.int32) for fill in (0, -1, -1))
    first = [d * seg + o for d, o in zip(shards, offset)]
    for (t, p, s), r in zip(entries, first):
        tokens[r:r + len(t)], positions[r:r + len(t)], slots[r:r + len(t)] = t, p, s
    return tokens, positions, slots, first


def pad(values: list[int], n: int, fill: int) -> np.ndarray:
    out = np.full(n, fill, np.int32)
    out[:len(values)] = values
    return out


def spec_batch(plan, spec_k, verify_row, draft, stops, n_slots: int, n_draft: int,
               verify_start: int) -> SpecBatch:
    """verify_row: per speculating entry, its first row; draft: the draft rows (tokens,
    positions, slots, padded to ``n_draft``) and per decode entry its row at L-1; stops: per
    speculating entry (stop ids, min_left, budget)."""
    order = sorted(spec_k)
    s = n_slots
    slots = pad([plan[i].request.slot for i in order], s, -1)
    width = max([len(stops[i][0]) for i in order] + [1])
    stop_ids = np.full((s, -(-width // 4) * 4), -1, np.int32)
    for r, i in enumerate(order):
        stop_ids[r, :len(stops[i][0])] = stops[i][0]
    d_tokens, d_pos, d_slots, d_last = draft
    return SpecBatch(
        slots=slots, length=pad([plan[i].request.num_tokens for i in order], s, 0),
        k=pad([spec_k[i] for i in order], s, 0), verify_row=pad([verify_row[i] for i in order], s, 0),
        stop_ids=stop_ids, min_left=pad([stops[i][1] for i in order], s, 0),
        budget=pad([stops[i][2] for i in order], s, 0),
        draft_tokens=pad(d_tokens, n_draft, 0), draft_positions=pad(d_pos, n_draft, -1),
        draft_slots=pad(d_slots, n_draft, -1), draft_last=pad([d_last.get(i, 0) for i in order], s, 0),
        verify_start=np.int32(verify_start))
