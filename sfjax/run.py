"""``RunConfig``: everything a compiled round is specialised on, in one static, hashable value,
validated once.

The engine builds one from its settings and the model (``Engine.run``); ``sfjax.functional``
users build one as ``functional.Config``. The round (``round.round_step``), the engine's several
rounds per call and ``sfjax.functional`` all take it; ``ModelConfig`` keeps only what config.json
means.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from pallas_kernels.paged_attention import IMPLS as ATTENTION_IMPLS
from pallas_kernels.matmul import KERNELS
from pallas_kernels.sampling import IMPLS as SAMPLER_IMPLS
from sfjax import checks as C
from sfjax import model, rows, sharding
from sfjax.config import ModelConfig, read_json
from sfjax.round import RoundConfig
from sfjax.spec import eagle
from sfjax.spec.config import SpeculativeConfig


MATMUL_KERNELS = (None, "auto", *KERNELS)
MAX_BLOCK_SIZE = 4096     # tokens a KV page holds
MAX_ROW_TILE = 1024       # rows a tile computes at once


def check_settings(owner: str, *, block_size: int, row_tile: int, sampler: str, layer_loop: str,
                   attention: str, matmul: str | None) -> None:
    """The rule for the settings a program is specialised on, wherever they are given
    (``RunConfig``, and the engine's ``EngineConfig`` before any model is read): a ValueError
    (TypeError for a wrong type) naming ``owner.field`` and what it allows."""
    f = lambda name: f"{owner}.{name}"
    allowed = f"a power of two in [1, {MAX_BLOCK_SIZE}]"
    if C.integer(f("block_size"), block_size, 1, MAX_BLOCK_SIZE, allowed=allowed) & (block_size - 1):
        raise ValueError(f"{f('block_size')} = {block_size} is out of range: must be {allowed}")
    C.integer(f("row_tile"), row_tile, 1, MAX_ROW_TILE)
    C.one_of(f("sampler"), sampler, SAMPLER_IMPLS)
    C.one_of(f("layer_loop"), layer_loop, model.LAYER_LOOPS)
    C.one_of(f("attention"), attention, ATTENTION_IMPLS)
    C.one_of(f("matmul"), matmul, MATMUL_KERNELS)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Static settings of a generation program (hashable; a pytree with no leaves, so it can be
    passed to a jitted function as is).

    model: the target's ``ModelConfig``.
    max_model_len: prompt + output tokens per row (the KV cache and token history hold this many).
    speculative_config: None (plain decoding) or ``LLM``'s dict / ``SpeculativeConfig``; for
        ``draft_model`` its "model" is the draft's ``ModelConfig`` (or an HF folder to read one
        from), and the draft weights are an argument of the calls.
    block_size, row_tile, sampler, layer_loop, attention: as ``LLM``'s; tokens equal the
        engine's for the same ``row_tile`` and ``attention``.
    mesh, draft_mesh: a (data, model) mesh the target (and the draft; default: the target's
        mesh) run on, under ``shard_map`` with the caches placed by ``sfjax.sharding`` (the
        engine's several rounds per call set them). Over dp > 1 data shards the batch B must be
        divisible by dp: row b is slot b, in data shard b // (B / dp), with its pages there.
    small_tiles, draft_small_tiles: row tiles below ``row_tile`` certified on this backend to
        give ``row_tile``'s bits for the target and the draft (``rows.certified_tiles``; the
        engine sets them on one CPU device); () runs ``row_tile`` tiles only.
    stage_tiles, draft_stage_tiles: (stage, tiles) pairs, the small tiles a stage of
        ``rows.STAGES`` runs in where not all of them (``rows.Tiling.stages``; the engine's
        come from ``rows.tune_stage_tiles``), each a subset of the model's small tiles.
    matmul: None runs every matmul in row tiles of ``row_tile`` (XLA dots); a
        ``pallas_kernels.matmul`` impl ("interpret", "triton", "mosaic_tpu") runs each as one
        batch-invariant Pallas launch over all of a call's rows (q|k|v and gate|up fused, each
        with its RMSNorm as the prologue; the small tiles are then unused); "auto" (resolved
        here, ``rows.kernel_for``): the kernel on GPU and TPU, the tile loop on CPU. Tokens are
        the same for either within one choice, not across the two.
    """
    model: ModelConfig
    max_model_len: int
    speculative_config: SpeculativeConfig | None = None
    block_size: int = 16
    row_tile: int = 8
    sampler: str = "auto"
    layer_loop: str = "auto"
    attention: str = "auto"
    mesh: Any = None
    draft_mesh: Any = None
    small_tiles: tuple[int, ...] = ()
    draft_small_tiles: tuple[int, ...] = ()
    matmul: str | None = "auto"
    stage_tiles: tuple = ()
    draft_stage_tiles: tuple = ()

    def __post_init__(self):
        f = lambda name: f"RunConfig.{name}"
        if not isinstance(self.model, ModelConfig):
            raise C.InvalidType(f"{f('model')}: must be a ModelConfig, got {type(self.model).__name__}")
        if self.mesh is not None and self.draft_mesh is None:
            object.__setattr__(self, "draft_mesh", self.mesh)
        spec = self.speculative_config
        if spec is not None:
            spec = SpeculativeConfig.from_dict(spec)
            if isinstance(spec.model, (str, os.PathLike)):
                folder = os.fspath(spec.model)
                try:
                    spec = dataclasses.replace(spec, model=eagle.HeadConfig.from_hf_config(
                        read_json(os.path.join(folder, "config.json")), self.model)
                        if spec.method == "eagle3" else ModelConfig.from_folder(folder))
                except ValueError as e:
                    if str(e).startswith("speculative_config"):
                        raise
                    raise ValueError(f"speculative_config.model: {folder!r}: {e}") from None
            if spec.method == "eagle3" and self.mesh is not None:
                raise ValueError("speculative_config.method = 'eagle3' runs on one device: "
                                 "RunConfig.mesh must be None (tensor and data parallelism "
                                 "serve draft_model and ngram)")
            spec.check_draft(self.model, self.max_model_len,
                             spec.model if isinstance(spec.model, ModelConfig) else None)
            object.__setattr__(self, "speculative_config", spec)
        limit, what = self.model.context
        C.integer(f("max_model_len"), self.max_model_len, 2, limit,
                  allowed=f"an int in [2, {what}]")
        check_settings("RunConfig", block_size=self.block_size, row_tile=self.row_tile,
                       sampler=self.sampler, layer_loop=self.layer_loop,
                       attention=self.attention, matmul=self.matmul)
        object.__setattr__(self, "matmul", rows.kernel_for(self.matmul, self.model, *(
            [self.draft] if self.draft is not None else [])))
        for name in ("small_tiles", "draft_small_tiles"):
            tiles = getattr(self, name)
            if not all(isinstance(t, int) and 0 < t < self.row_tile and self.row_tile % t == 0
                       for t in tiles):
                raise ValueError(f"{f(name)} = {tiles!r} is out of range: must be tiles below "
                                 f"row_tile ({self.row_tile}) that divide it")
            object.__setattr__(self, name, tuple(sorted(set(tiles))))
        for name, small in (("stage_tiles", self.small_tiles),
                            ("draft_stage_tiles", self.draft_small_tiles)):
            object.__setattr__(self, name, _stages(f(name), getattr(self, name), small))

    @property
    def head(self):
        """The EAGLE-3 head's ``eagle.HeadConfig`` (``eagle3`` only)."""
        spec = self.speculative_config
        return spec.model if spec is not None and spec.method == "eagle3" else None

    @property
    def draft(self) -> ModelConfig | None:
        """The draft model's config (``draft_model`` only)."""
        spec = self.speculative_config
        return spec.model if spec is not None and spec.method == "draft_model" else None

    @property
    def round(self) -> RoundConfig | None:
        """The speculative round's proposer and rule; None for plain decoding."""
        spec = self.speculative_config
        return None if spec is None else RoundConfig.of(spec)

    @property
    def tiling(self) -> rows.Tiling:
        """How the target's calls compute their rows."""
        return rows.Tiling(self.row_tile, self.small_tiles, self.matmul, self.stage_tiles)

    @property
    def draft_tiling(self) -> rows.Tiling:
        """How the draft model's calls compute their rows."""
        return rows.Tiling(self.row_tile, self.draft_small_tiles, self.matmul,
                           self.draft_stage_tiles)

    @property
    def head_tiling(self) -> rows.Tiling:
        """How an EAGLE head's calls compute their rows (no small tile is certified for it)."""
        return rows.Tiling(self.row_tile, (), self.matmul)

    def k_table(self, slots: int) -> np.ndarray | None:
        """Adaptive k's table for rounds over ``slots`` slots (``SpeculativeConfig.k_table``, by
        this run's row tiles, kernel and data shards); None without adaptive_k. The engine's
        host and its rounds read this one table."""
        spec = self.speculative_config
        if spec is None or not spec.adaptive_k:
            return None
        return spec.k_table(self.model, slots, row_tile=self.row_tile, small=self.small_tiles,
                            tiled=self.matmul is None, dp=sharding.dp_of(self.mesh))

    @property
    def k_max(self) -> int:
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    @property
    def unrolled(self) -> bool:
        """Whether the layers run unrolled over weights split by layer (``model.unrolled``)."""
        return model.unrolled(self.layer_loop)

    def of_device(self) -> "RunConfig":
        """What the device programs are specialised on: this run without the target's and the
        draft's special token ids (the host puts stop ids in the sampling table; no program
        reads them), so models that differ only there share compiled programs."""
        untag = lambda m: (dataclasses.replace(m, bos_token_id=None, eos_token_ids=())
                           if isinstance(m, ModelConfig) else m)
        spec = self.speculative_config
        return dataclasses.replace(self, model=untag(self.model), speculative_config=None if (
            spec is None) else dataclasses.replace(spec, model=untag(spec.model)))

    def plain(self) -> "RunConfig":
        """The same run without speculation: what a plain round is specialised on (shared by
        plain and speculating engines of one model)."""
        return dataclasses.replace(self, speculative_config=None, draft_mesh=None,
                                   draft_small_tiles=(), draft_stage_tiles=())


def _stages(field: str, stages, small: tuple[int, ...]) -> tuple:
    """``stages`` ((stage, tiles) pairs) as ``rows.Tiling.stages``: each stage of ``rows.STAGES``
    at most once, its tiles among ``small``; else ValueError naming ``field``."""
    try:
        pairs = tuple((stage, tuple(sorted(set(tiles)))) for stage, tiles in stages)
    except (TypeError, ValueError):
        pairs = None
    names = [stage for stage, _ in pairs or ()]
    if (pairs is None or len(set(names)) != len(names)
            or not all(stage in rows.STAGES and set(t) <= set(small) for stage, t in pairs)):
        raise ValueError(f"{field} = {stages!r} is out of range: must be (stage, tiles) pairs, "
                         f"each stage of {rows.STAGES} at most once, its tiles among the small "
                         f"tiles {small}")
    return tuple(sorted(pairs, key=lambda p: rows.STAGES.index(p[0])))
