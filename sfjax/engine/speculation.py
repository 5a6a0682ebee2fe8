"""The host side of speculative decoding: the draft model or EAGLE head and its state, per-row k,
and the spec-decode counters (the rows of a round are ``engine.batch``'s)."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from sfjax import sharding
from sfjax.cache import KVCache
from sfjax.config import ModelConfig
from sfjax.engine.scheduler import Request
from sfjax.spec import eagle, table
from sfjax.spec.config import SpeculativeConfig, adaptive_k, draft_cap, drafts_for, kind_counts
from sfjax.spec.registry import Registry, Strategy


@dataclasses.dataclass
class SpecMetrics:
    """vLLM's spec-decode counters (vllm:spec_decode_num_*)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    num_rejections: int = 0       # drafting rounds that rejected a draft (adaptive_k reads them)
    copy_accepted: int = 0        # of the accepted drafts and those rounds, the copies'
    copy_rejections: int = 0      # (``ngram``'s match in its own tokens), weighed apart

    def add(self, k: int, accepted: int) -> None:
        if k <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        self.num_rejections += accepted < k
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos += [0] * (k - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def copied(self, accepted: int, rejections: int, total: "SpecMetrics") -> None:
        """Takes the copies' counts as the device has them now (``step.Progress``), and adds
        what they grew by to the engine's ``total``."""
        total.copy_accepted += accepted - self.copy_accepted
        total.copy_rejections += rejections - self.copy_rejections
        self.copy_accepted, self.copy_rejections = accepted, rejections

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
                "num_accepted_copy_tokens": self.copy_accepted,
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length}


class Speculator:
    """The engine's speculation: config, the draft model and its cache, and the certificate."""

    def __init__(self, config: SpeculativeConfig, cfg: ModelConfig, max_model_len: int,
                 num_blocks: int, block_size: int, draft: tuple | None = None,
                 registry: Registry | None = None, mesh=None, split: bool = False, tiles=None,
                 embed=None, max_num_seqs: int = 1):
        """``draft``: the draft model's (config, weights), or for ``eagle3`` the head's
        (``eagle.HeadConfig``, ``eagle.HeadWeights``), which shares the target's placed
        embedding ``embed`` unless it has its own and keeps state for ``max_num_seqs`` slots.
        ``tiles``: (cfg, placed weights) -> the model's certified small row tiles and each
        stage's among them (the engine's ``rows.certified_tiles``), for the draft."""
        self.config = config
        self.k_max = config.num_speculative_tokens
        self.head_cfg = None               # eagle3: the head's config; the draft model is None
        if config.method == "eagle3":
            if mesh is not None:
                raise ValueError("speculative_config.method = 'eagle3' runs on one device: "
                                 "tensor_parallel_size and data_parallel_size must be 1")
            self.head_cfg, head = draft
            draft = None
        self.draft_cfg, self.draft_weights = draft if draft else (None, None)
        config.check_draft(cfg, max_model_len, self.draft_cfg)
        self.max_model_len = config.draft_limit(max_model_len, self.draft_cfg)
        self.registry = registry or Registry()
        self.slot = self.registry.register(Strategy(config.method, config.acceptance_method))
        self.certificate = self.registry.slots[self.slot]
        self.mesh = None
        self.small_tiles: tuple[int, ...] = ()      # the draft's certified small row tiles
        self.stage_tiles: tuple = ()                # and each stage's among them
        if self.draft_cfg is not None and mesh is not None:
            self.mesh = sharding.draft_mesh(mesh, config.draft_tensor_parallel_size
                                            or sharding.tp_of(mesh))
            sharding.validate(self.draft_cfg, self.mesh, "draft")
        if self.draft_cfg is not None:
            self.draft_weights = sharding.place_weights(self.draft_weights, self.draft_cfg, self.mesh,
                                                     split)
            if tiles is not None and self.mesh is None:
                self.small_tiles, self.stage_tiles = tiles(self.draft_cfg, self.draft_weights)
        if config.prompt_lookup_table is not None:      # the n-gram table rides as "draft weights"
            t = table.load(config.prompt_lookup_table, cfg.vocab_size)
            self.draft_weights = t if mesh is None else sharding.put(
                t, jax.tree.map(lambda _: P(), t), mesh)
        self._cache_shape = num_blocks, block_size, max_num_seqs
        if self.head_cfg is not None:
            self.draft_weights = eagle.place(head, embed)
        self.metrics = SpecMetrics()
        self.k_table = None          # adaptive k's (``RunConfig.k_table``), the engine's run's

    def initial_cache(self):
        """The proposer's state before any request (the slot state's ``draft_cache``): the draft
        model's empty pages, an EAGLE head's empty ``HeadState``, or None (n-gram)."""
        num_blocks, block_size, max_num_seqs = self._cache_shape
        if self.head_cfg is not None:
            return eagle.HeadState.zeros(self.head_cfg, num_blocks, block_size, max_num_seqs)
        if self.draft_cfg is not None:
            return KVCache.zeros(self.draft_cfg, num_blocks, block_size, mesh=self.mesh)
        return None

    @property
    def round_model(self):
        """What the round's ``speculative_config.model`` is: the draft's ``ModelConfig``, the
        head's ``eagle.HeadConfig``, or None (``ngram``)."""
        return self.head_cfg if self.head_cfg is not None else self.draft_cfg

    def k_for(self, req: Request, budget: int, live: int) -> int:
        """Drafts for this row this round, one of ``live`` decoding rows: 0 if it opted out, is
        past the draft's max_model_len, or has at most one token left to emit."""
        if req.strategy_slot != self.slot:
            return 0
        k = self.k_max
        free = self.config.method == "ngram" and not self.config.draft_cost
        if self.k_table is not None and not free:        # adaptive_k: from its acceptance
            # (free drafts: up to k_max, as the device may fill its last tile with them)
            m = req.spec_metrics or SpecMetrics()
            cap = draft_cap(k, budget, req.num_tokens, self.max_model_len)
            # whether a row drafts a copy only the device knows (``ngram`` looks up there): the
            # bound is the larger k of the two kinds
            kinds = (False, True) if self.config.method == "ngram" else (False,)
            return max(int(adaptive_k(self.k_table, *kind_counts(
                m.num_accepted_tokens, m.num_rejections, m.copy_accepted, m.copy_rejections, copy),
                live, len(req.output_token_ids), cap, copy=copy)) for copy in kinds)
        return int(drafts_for(k, budget, req.num_tokens, self.max_model_len))
