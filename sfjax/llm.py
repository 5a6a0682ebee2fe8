"""The vLLM-shaped offline facade: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from sfjax import sharding
from sfjax import checks as C
from sfjax.checks import InvalidType
from sfjax.chat import ChatTemplate
from sfjax.config import ModelConfig, sampling_defaults
from sfjax.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from sfjax.engine.engine import Engine, check_model_settings
from sfjax.outputs import RequestOutput
from sfjax.sampling_params import SamplingParams
from sfjax.spec import eagle
from sfjax.spec.config import SpeculativeConfig
from sfjax.tokenizer import eos_ids, load_tokenizer
from sfjax.weights import load


DTYPES = ("auto", "float32", "bfloat16", "float16")


def _mesh(tp: int, dp: int, mesh):
    """The engine's mesh: ``mesh`` (its axes must agree with tp and dp unless both are 1), else
    one of tp * dp devices, else None (one device)."""
    if mesh is None:
        return sharding.make_mesh(tp, dp) if tp * dp > 1 else None
    mesh = sharding.as_mesh(mesh)
    got = (sharding.tp_of(mesh), sharding.dp_of(mesh))
    if (tp, dp) not in ((1, 1), got):
        raise ValueError(f"tensor_parallel_size {tp} and data_parallel_size {dp} differ from the "
                         f"mesh's model and data axes {got}")
    return mesh


def _load_draft(spec: SpeculativeConfig | None, target: ModelConfig, dtype: str):
    """What ``spec`` drafts with: (config, weights) of a draft model, an EAGLE-3 head, or None."""
    if spec is None or spec.method not in ("draft_model", "eagle3"):
        return None
    path = os.fspath(spec.model)
    if not os.path.isdir(path):
        raise ValueError(f"speculative_config.model: {path!r} is not a folder")
    if spec.method == "eagle3":
        return eagle.load(path, target)
    try:
        cfg = ModelConfig.from_folder(path, dtype)
    except ValueError as e:          # e.g. an EAGLE head's folder given as a draft model
        raise ValueError(f"speculative_config.model: {path!r}: {e}") from None
    return cfg, load(path, cfg)


class LLM:
    """An engine over one HF model folder (config.json, safetensors, tokenizer.json), or an
    ``sfjax convert`` export (its weights an orbax checkpoint, restored straight into the mesh's
    shards).

    ``model=None`` serves the embedded default model. ``tensor_parallel_size`` and
    ``data_parallel_size`` shard it over a (data, model) mesh of the first tp * dp devices; or pass
    a ``mesh`` (axes ``data`` and ``model``) built by the calling JAX program. Each data shard
    serves max_num_seqs / dp slots from its own num_kv_blocks / dp KV pages; ``kv_cache_bytes``
    caps the default cache's pages per device. ``compiler_options`` (a dict of XLA options, e.g.
    ``{"xla_gpu_autotune_level": 0}``) go to every program the engine compiles. Bad input raises
    ValueError naming the problem before anything runs: for ``generate``, every prompt and its
    SamplingParams are checked first, and if one is refused nothing of the call is enqueued, so
    no request is half-run or lost; requests already in the engine carry on.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, tokenizer: str | None = None,
                 dtype: str = "auto", block_size: int = 16, num_kv_blocks: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 32,
                 max_num_batched_tokens: int | None = None, seed: int = 0, row_tile: int = 8,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES, sampler: str = "auto",
                 attention: str = "auto", enable_prefix_caching: bool = True,
                 num_scheduler_steps: int = 8, async_scheduling: bool = True,
                 small_row_tiles: bool = True,
                 layer_loop: str = "auto", matmul: str | None = "auto",
                 compiler_options: dict | None = None,
                 speculative_config: dict | SpeculativeConfig | None = None,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, mesh=None):
        if model is None:
            from sfjax.default_model import default_model_path
            model = default_model_path()
        if not isinstance(model, (str, os.PathLike)):
            raise InvalidType(f"model = {model!r}: must be a path to a model folder")
        model = os.fspath(model)
        C.one_of("dtype", dtype, DTYPES)
        tp = C.integer("tensor_parallel_size", tensor_parallel_size, 1)
        dp = C.integer("data_parallel_size", data_parallel_size, 1)
        config = EngineConfig(          # checked before anything is loaded
            block_size=block_size, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            seed=seed, row_tile=row_tile, kv_cache_bytes=kv_cache_bytes, sampler=sampler,
            attention=attention, enable_prefix_caching=enable_prefix_caching,
            num_scheduler_steps=num_scheduler_steps, async_scheduling=async_scheduling,
            small_row_tiles=small_row_tiles,
            layer_loop=layer_loop, matmul=matmul, compiler_options=compiler_options)
        spec = SpeculativeConfig.from_dict(speculative_config) if speculative_config is not None else None
        if not os.path.isdir(model):
            raise ValueError(f"model: {model!r} is not a folder (an HF model folder is expected)")
        if spec is not None and spec.method == "eagle3" and (tp * dp > 1 or mesh is not None):
            raise ValueError("speculative_config.method = 'eagle3' runs on one device: "
                             "tensor_parallel_size and data_parallel_size must be 1")
        mesh = _mesh(tp, dp, mesh)
        draft_tp, target_tp = spec and spec.draft_tensor_parallel_size, sharding.tp_of(mesh) if mesh else 1
        if draft_tp and target_tp % draft_tp:
            raise ValueError(f"speculative_config.draft_tensor_parallel_size ({draft_tp}) must "
                             f"divide the target's tensor_parallel_size ({target_tp})")
        self.model_path = model
        self.model_config = ModelConfig.from_folder(model, dtype)
        check_model_settings(self.model_config, config, mesh)      # before the weights load
        # the SamplingParams fields generation_config.json sets (``get_default_sampling_params``)
        self.generation_defaults = sampling_defaults(model)
        try:
            SamplingParams(**self.generation_defaults)
        except (ValueError, TypeError) as e:
            raise type(e)(f"generation_config.json: {e}") from None
        self.tokenizer = load_tokenizer(tokenizer or model)
        self.chat_template = ChatTemplate(tokenizer or model)
        weights = load(model, self.model_config, mesh)
        self.engine = Engine(self.model_config, weights, self.tokenizer, config,
                             eos_ids(model, tokenizer or model, self.tokenizer,
                                     self.model_config.vocab_size, self.model_config.eos_token_ids),
                             spec,
                             _load_draft(spec, self.model_config, dtype), mesh)
        self._next_id = 0

    def get_tokenizer(self):
        """The model's ``tokenizers.Tokenizer`` (Hugging Face's fast tokenizer itself, not
        vLLM's transformers wrapper: ``encode(text).ids`` gives the ids;
        ``transformers.PreTrainedTokenizerFast(tokenizer_object=...)`` wraps it where code
        wants ``apply_chat_template`` or ``eos_token_id``; ``LLM.chat`` renders chats)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation_config.json defaults (temperature,
        top_p, top_k, min_p, repetition_penalty; max_new_tokens as max_tokens), what
        ``generate`` uses when given none."""
        return SamplingParams(**self.generation_defaults)

    def default_request(self) -> tuple[SamplingParams, int | None]:
        """(params, max_tokens cap) of a request given no SamplingParams: the model's defaults,
        its max_new_tokens a cap on the rest of the context (``Engine.prepare``), so a long
        prompt is not refused for it; without one, vLLM's 16 tokens."""
        cap = self.generation_defaults.get("max_tokens")
        params = self.get_default_sampling_params()
        return (params, None) if cap is None else (dataclasses.replace(params, max_tokens=None), cap)

    def reset_prefix_cache(self) -> None:
        """Forgets the prefix cache's blocks (outputs never depend on it, only speed does)."""
        self.engine.allocator.reset_prefix_cache()

    def get_metrics(self) -> dict:
        """Engine counters; with speculation, vLLM's spec-decode counters under "spec_decode"."""
        return self.engine.get_metrics()

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True) -> list[RequestOutput]:
        """Generates for each prompt (a str, a list of str, or dicts with ``prompt_token_ids``);
        returns RequestOutputs in input order, for these prompts only. Requests added to the
        engine by other means keep running meanwhile; their outputs are left for the engine's
        next ``step()``. ``use_tqdm``: whether to show a progress bar, or (vLLM's) the tqdm
        class to make it with."""
        prompts = self._prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        requests, sizes, arrivals = [], [], self.engine._arrivals
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            p, cap = (p, None) if p is not None else self.default_request()
            try:
                children = p.checked().children() if isinstance(p, SamplingParams) else [p]
                requests += [self.engine.prepare(self._new_id(), prompt, c, cap) for c in children]
            except ValueError as e:       # InvalidType is one too
                self.engine._arrivals = arrivals     # nothing of the call happened
                raise type(e)(f"prompt {i}: {e}") from None
            sizes.append(len(children))
        for req in requests:
            self.engine.enqueue(req)
        outs = iter(self._run(requests, use_tqdm))
        return [_gathered([next(outs) for _ in range(n)]) for n in sizes]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's: generates a reply to each conversation (a list of {"role", "content"}
        messages, or a list of such lists) rendered by the model's chat template, as the
        server's chat completions render it; ValueError naming ``messages`` for a model without
        a template or a message it cannot take; ``chat_template_kwargs``: more variables for the
        template (vLLM's; e.g. Qwen3's ``enable_thinking``)."""
        batch = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        prompts = []
        for i, conversation in enumerate(batch):
            try:
                prompts.append(self.chat_template.prompt(self.tokenizer, conversation,
                                                         add_generation_prompt,
                                                         chat_template_kwargs))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}" if len(batch) > 1 else str(e)) from None
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _prompt_list(prompts: Any) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            return list(prompts)
        raise InvalidType(f"prompts: must be a str, a dict with 'prompt_token_ids', or a list of "
                          f"them; got {type(prompts).__name__}")

    def _new_id(self) -> str:
        """The next free number as a request id (vLLM's ids), skipping any the engine holds or
        still has an output for: a user's request "3" is never taken."""
        while True:
            rid = str(self._next_id)
            self._next_id += 1
            if not self.engine.holds(rid):
                return rid

    def _run(self, requests: list, use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        """Steps the engine until these requests end; the progress bar counts output tokens
        (a request that ends early gives the bar the rest of its budget)."""
        ids = [r.request_id for r in requests]
        budget = {r.request_id: r.max_tokens for r in requests}
        pending, done = set(ids), {}
        bar = (use_tqdm if callable(use_tqdm) else tqdm)(
            total=sum(budget.values()), desc="Generating", unit="tok", dynamic_ncols=True,
            disable=not use_tqdm)
        start, n_in = time.monotonic(), 0
        try:
            while pending:
                outs = self.engine.step()
                self.engine.put_back([o for o in outs if o.request_id not in pending])
                for out in outs:
                    if out.request_id not in pending:
                        continue
                    bar.update(len(out.new_token_ids))
                    if out.finished:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        n_in += len(out.prompt_token_ids)
                        bar.update(budget[out.request_id] - len(out.outputs[0].token_ids))
                if not bar.disable:
                    bar.set_postfix_str(self._postfix(len(done), len(ids), n_in, start))
        finally:    # left early (Ctrl-C, an error): its requests must not run on in later calls
            for rid in pending:
                self.engine.drop(rid)
            bar.close()
        return [done[i] for i in ids]

    def _postfix(self, finished: int, total: int, n_in: int, start: float) -> str:
        elapsed = max(time.monotonic() - start, 1e-9)
        text = f"{finished}/{total} prompts, input {n_in / elapsed:.1f} tok/s"
        if self.engine.spec is not None:
            m = self.engine.spec.metrics
            text += (f", acceptance {m.acceptance_rate:.2f} "
                     f"(mean length {m.mean_acceptance_length:.2f})")
        return text


def _gathered(outs: list[RequestOutput]) -> RequestOutput:
    """One prompt's n outputs as one (vLLM's parallel sampling): the first's, with every
    completion in order, ``index`` i the i-th, and the first failed one's error."""
    if len(outs) == 1:
        return outs[0]
    return dataclasses.replace(outs[0], outputs=[dataclasses.replace(o.outputs[0], index=i)
                                                 for i, o in enumerate(outs)],
                               error=next((o.error for o in outs if o.error), None))
