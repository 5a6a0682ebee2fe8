"""The vLLM-shaped offline facade: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from sfjax import sharding
from sfjax.config import ModelConfig
from sfjax.engine.engine import DEFAULT_KV_CACHE_BYTES, Engine, EngineConfig
from sfjax.outputs import RequestOutput
from sfjax.sampling_params import SamplingParams
from sfjax.spec.config import SpeculativeConfig
from sfjax.tokenizer import generation_eos_ids, load_tokenizer
from sfjax.weights import load


class LLM:
    """An engine over one HF model folder (config.json, safetensors, tokenizer.json), or an
    ``sfjax convert`` export (its weights an orbax checkpoint, restored straight into the mesh's
    shards).

    ``model=None`` serves the embedded default model. ``tensor_parallel_size`` and
    ``data_parallel_size`` shard it over a (data, model) mesh of the first tp * dp devices; or pass
    a ``mesh`` (axes ``data`` and ``model``) built by the calling JAX program. Each data shard
    serves max_num_seqs / dp slots from its own num_kv_blocks / dp KV pages; ``kv_cache_bytes``
    caps the default cache's pages per device. Bad input raises ValueError naming the
    problem before anything runs: for ``generate``, every prompt and its SamplingParams are
    checked first, and if one is refused nothing of the call is enqueued, so no request is
    half-run or lost; requests already in the engine carry on.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, tokenizer: str | None = None,
                 dtype: str = "auto", block_size: int = 16, num_kv_blocks: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 32,
                 max_num_batched_tokens: int | None = None, seed: int = 0, row_tile: int = 8,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES, sampler: str = "auto",
                 attention: str = "auto", enable_prefix_caching: bool = True,
                 num_scheduler_steps: int = 8, small_row_tiles: bool = True,
                 speculative_config: dict | SpeculativeConfig | None = None,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, mesh=None):
        if model is None:
            from sfjax.default_model import default_model_path
            model = default_model_path()
        model = os.fspath(model)
        if not os.path.isdir(model):
            raise ValueError(f"model: {model!r} is not a folder (an HF model folder is expected)")
        if mesh is None and tensor_parallel_size * data_parallel_size > 1:
            mesh = sharding.make_mesh(tensor_parallel_size, data_parallel_size)
        elif mesh is not None:
            mesh = sharding.as_mesh(mesh)
            got = (sharding.tp_of(mesh), sharding.dp_of(mesh))
            if (tensor_parallel_size, data_parallel_size) not in ((1, 1), got):
                raise ValueError(f"tensor_parallel_size {tensor_parallel_size} and data_parallel_size "
                                 f"{data_parallel_size} differ from the mesh's model and data axes {got}")
        self.model_path = model
        self.model_config = ModelConfig.from_folder(model, dtype)
        self.tokenizer = load_tokenizer(tokenizer or model)
        weights = load(model, self.model_config, mesh)
        config = EngineConfig(
            block_size=block_size, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max(512, max_num_seqs),
            seed=seed, row_tile=row_tile, kv_cache_bytes=kv_cache_bytes, sampler=sampler,
            attention=attention, enable_prefix_caching=enable_prefix_caching,
            num_scheduler_steps=num_scheduler_steps, small_row_tiles=small_row_tiles)
        spec = SpeculativeConfig.from_dict(speculative_config) if speculative_config else None
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft_path = os.fspath(spec.model)
            if not os.path.isdir(draft_path):
                raise ValueError(f"speculative_config.model: {draft_path!r} is not a folder")
            draft_cfg = ModelConfig.from_folder(draft_path, dtype)
            draft = (draft_cfg, load(draft_path, draft_cfg))
        self.engine = Engine(self.model_config, weights, self.tokenizer, config,
                             generation_eos_ids(model, self.model_config.eos_token_ids), spec, draft,
                             mesh)
        self._next_id = 0

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forgets the prefix cache's blocks (outputs never depend on it, only speed does)."""
        self.engine.allocator.reset_prefix_cache()

    def get_metrics(self) -> dict:
        """Engine counters; with speculation, vLLM's spec-decode counters under "spec_decode"."""
        return self.engine.get_metrics()

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for each prompt (a str, a list of str, or dicts with ``prompt_token_ids``);
        returns RequestOutputs in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                requests.append(self.engine.prepare(str(self._next_id + i), prompt, p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        self._next_id += len(prompts)
        for req in requests:
            self.engine.enqueue(req)
        return self._run([r.request_id for r in requests], use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, n_in, n_out = time.monotonic(), 0, 0
        while pending:
            for out in self.engine.step():
                n_out += len(out.new_token_ids)
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    done[out.request_id] = out
                    n_in += len(out.prompt_token_ids)
                    bar.update(1)
                    elapsed = max(time.monotonic() - start, 1e-9)
                    postfix = (f"est. speed input: {n_in / elapsed:.2f} toks/s, "
                               f"output: {n_out / elapsed:.2f} toks/s")
                    if self.engine.spec is not None:
                        m = self.engine.spec.metrics
                        postfix += (f", acceptance rate: {m.acceptance_rate:.2f}, "
                                    f"mean acceptance length: {m.mean_acceptance_length:.2f}")
                    bar.set_postfix_str(postfix)
        bar.close()
        return [done[i] for i in ids]
