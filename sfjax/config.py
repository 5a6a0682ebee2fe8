"""``ModelConfig``: what an HF ``config.json`` means, frozen and hashable (the engine's settings are
``engine.EngineConfig``, a program's are ``run.RunConfig``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from sfjax import checks as C

# model_type -> the architecture config.json names: Mistral is Llama's network (a sliding window,
# which sfjax does not implement, bounds its context: ``ModelConfig.context``), Qwen2 Llama's
# with biases on the q, k and v projections (``ModelConfig.qkv_bias``), Qwen3 Llama's with an
# RMSNorm of each query and key head before RoPE (``ModelConfig.qk_norm``)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES.values())
_USE_SLIDING_WINDOW = ("qwen2", "qwen3")       # config.json's flag; sfjax serves it false
# transformers' defaults, by model_type, for num_key_value_heads, max_position_embeddings,
# head_dim and Mistral's sliding_window where a config.json leaves them out (Llama's: heads,
# 2048 positions, hidden / heads); sfjax requires the sizes and has no default token ids
_DEFAULTS = {"llama": {}, "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072,
                                      "sliding_window": 4096},
             "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
             "qwen3": {"num_key_value_heads": 32, "max_position_embeddings": 32768,
                       "head_dim": 128}}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF ``rope_scaling``: ``llama3`` (frequency bands) or ``linear`` (position interpolation)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family model, static and hashable so jitted functions can take it as is."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"                # a key of ``ARCHITECTURES``
    sliding_window: int | None = None        # Mistral's: each query attends to its last W keys

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type must be one of {sorted(ARCHITECTURES)}, got "
                             f"{self.model_type!r}")
        if self.sliding_window is not None and self.model_type != "mistral":
            raise ValueError("sliding_window: only a mistral model has one")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def qkv_bias(self) -> bool:
        """Whether the q, k and v projections add a bias (Qwen2's)."""
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Whether each query and key head is RMS-normed before RoPE (Qwen3's)."""
        return self.model_type == "qwen3"

    @property
    def context(self) -> tuple[int, str]:
        """(the most positions sfjax runs this model at, what sets it): max_position_embeddings,
        or a shorter sliding window. sfjax attends to every key of a sequence, which is the
        window's attention exactly while a sequence holds at most ``sliding_window`` tokens."""
        mpe = self.max_position_embeddings
        if self.sliding_window is not None and self.sliding_window < mpe:
            return self.sliding_window, (f"the model's sliding_window ({self.sliding_window}; "
                                         f"sfjax has no sliding-window attention)")
        return mpe, f"the model's max_position_embeddings ({mpe})"

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], dtype: str = "auto") -> "ModelConfig":
        """Converts a ``config.json`` dict of an architecture in ``ARCHITECTURES``; raises
        ValueError naming the field on anything else."""
        if not isinstance(hf, dict):
            raise ValueError(f"config.json: must be a JSON object, got {type(hf).__name__}")
        kind = _supported(hf)
        given, hf = hf, {**_DEFAULTS[kind], **hf}       # transformers' defaults where left out
        n = lambda name, default=None, lo=1: _int(hf, name, default, lo)
        heads, hidden = n("num_attention_heads"), n("hidden_size")
        if "num_key_value_heads" not in given and heads % n("num_key_value_heads", heads):
            raise ValueError(f"config.json leaves out num_key_value_heads, and transformers' "
                             f"default for {kind} ({hf['num_key_value_heads']}) does not divide "
                             f"num_attention_heads ({heads})")
        if dtype == "auto":
            dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
            if dtype not in _DTYPES:
                raise ValueError(f"config.json: dtype {dtype!r} is not supported "
                                 f"({', '.join(sorted(_DTYPES))}); dtype= (--dtype) loads the "
                                 f"weights as one of them")
        bos = C.integer("config.json: bos_token_id", hf.get("bos_token_id"), 0, optional=True)
        theta, scaling, field = _rope(hf)
        return cls(
            vocab_size=n("vocab_size"), hidden_size=hidden,
            intermediate_size=n("intermediate_size"), num_layers=n("num_hidden_layers"),
            num_heads=heads, num_kv_heads=n("num_key_value_heads", heads),
            head_dim=n("head_dim", hidden // heads),
            rope_theta=theta,
            rope_scaling=_rope_scaling(scaling, hf, field),
            rms_norm_eps=C.real("config.json: rms_norm_eps", hf.get("rms_norm_eps", 1e-6), 0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=n("max_position_embeddings", 2048, 2),
            dtype=dtype,
            bos_token_id=bos,
            eos_token_ids=token_ids("config.json: eos_token_id", hf.get("eos_token_id")),
            model_type=kind,
            sliding_window=_sliding_window(hf, kind),
        )

    @classmethod
    def from_folder(cls, path: str | os.PathLike, dtype: str = "auto") -> "ModelConfig":
        return cls.from_hf_config(read_json(os.path.join(path, "config.json")), dtype)

    def to_hf_config(self) -> dict[str, Any]:
        out = {
            "architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
        }
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.model_type in _USE_SLIDING_WINDOW:
            out["use_sliding_window"] = False
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": rs.factor}
        elif rs is not None:
            out["rope_scaling"] = dataclasses.asdict(rs)
        return out

    def num_params(self) -> int:
        d, f, L = self.hidden_size, self.intermediate_size, self.num_layers
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        bias = self.head_dim * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        bias += 2 * self.head_dim if self.qk_norm else 0
        return self.vocab_size * d + head + L * (attn + bias + 3 * d * f + 2 * d) + d


def _supported(hf: dict[str, Any]) -> str:
    """config.json's model_type, where sfjax serves it as written (ValueError naming what not)."""
    kind = hf.get("model_type", "llama")
    archs = hf.get("architectures")
    if not isinstance(kind, str) or kind not in ARCHITECTURES or archs not in (
            None, [], [ARCHITECTURES[kind]]):
        raise ValueError(
            f"unsupported architecture {archs} (model_type={hf.get('model_type')!r}); "
            f"sfjax serves {', '.join(f'{a} ({t})' for t, a in ARCHITECTURES.items())}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"config.json: {flag}=true is not supported")
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"config.json: quantization_config ({method}) is not supported: "
                         f"sfjax loads float32, bfloat16 and float16 weights")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if kind in _USE_SLIDING_WINDOW and (hf.get("use_sliding_window") or "sliding_attention" in (
            hf.get("layer_types") or ())):
        raise ValueError("config.json: use_sliding_window=true is not supported (sfjax "
                         "attends to every key)")
    return kind


def token_ids(field: str, value: Any) -> tuple[int, ...]:
    """An ``eos_token_id`` as config.json and generation_config.json give it (an id, a list of
    them, or null) as a tuple; ValueError naming ``field`` for anything else."""
    if value is None:
        return ()
    return tuple(C.int_list(field, value if isinstance(value, list) else [value], 0))


def _int(hf: dict[str, Any], name: str, default: int | None, lo: int) -> int:
    """config.json's int ``name`` (``default`` where absent or null; required without one)."""
    value = hf.get(name)
    if value is None and default is None:
        raise ValueError(f"config.json is missing the field {name!r}")
    return C.integer(f"config.json: {name}", default if value is None else value, lo)


def _sliding_window(hf: dict[str, Any], kind: str) -> int | None:
    """Mistral's sliding window (None: none, or another model's field transformers ignores; a
    Mistral config.json without the key has transformers' 4096, ``_DEFAULTS``)."""
    if kind != "mistral":
        return None
    return C.integer("config.json: sliding_window", hf.get("sliding_window"), 1, optional=True)


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None, str]:
    """(rope_theta, the scaling dict, its field): transformers 5 writes both in ``rope_parameters``,
    earlier versions as ``rope_theta`` and ``rope_scaling``; ``rope_parameters`` wins, as it
    does in transformers."""
    rp = hf.get("rope_parameters")
    theta = lambda x: C.real("config.json: rope_theta", x, 0, lo_open=True)
    if rp is None:
        return theta(hf.get("rope_theta", 10000.0)), hf.get("rope_scaling"), "rope_scaling"
    rp = {"rope_type": "default", **rp} if isinstance(rp, dict) and "type" not in rp else rp
    if not isinstance(rp, dict) or any(isinstance(v, dict) for v in rp.values()):
        raise ValueError(f"config.json: rope_parameters {rp!r} is not supported (one dict for "
                         f"every layer, as Llama's)")
    return theta(rp.get("rope_theta", hf.get("rope_theta", 10000.0))), rp, "rope_parameters"


def _rope_scaling(rs: dict[str, Any] | None, hf: dict[str, Any],
                  field: str = "rope_scaling") -> RopeScaling | None:
    """The scaling as transformers reads it: llama3 needs its factors (transformers raises a
    KeyError without them), and its original_max_position_embeddings is config.json's own field
    where it has one, else the dict's, else max_position_embeddings."""
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise ValueError(f"config.json: {field} {rs!r} must be a JSON object or null")
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ValueError(f"config.json: rope type {kind!r} is not supported (default, llama3, "
                         f"linear)")
    needed = ("factor", "low_freq_factor", "high_freq_factor") if kind == "llama3" else ("factor",)
    if missing := [k for k in needed if k not in rs]:
        raise ValueError(f"config.json: {field}.{missing[0]} is missing ({kind} rope needs "
                         f"{', '.join(needed)})")
    own = "original_max_position_embeddings"
    if kind == "llama3":       # config.json's own field first, as transformers takes it
        where = own if own in hf else f"{field}.{own}"
        rs = {**rs, own: hf.get(own, rs.get(own, hf.get("max_position_embeddings", 2048)))}
    fields = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type"}

    def number(k, v):
        if k == own:
            return C.integer(f"config.json: {where}", v, 1)
        return C.real(f"config.json: {field}.{k}", v, 0, lo_open=True)
    return RopeScaling(rope_type=kind, **{k: number(k, v) for k, v in rs.items() if k in fields})


# generation_config.json's sampling fields that vLLM takes as a model's defaults, by the
# SamplingParams field each sets
SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                     "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                     "max_new_tokens": "max_tokens"}


def generation_config(path: str | os.PathLike) -> dict[str, Any]:
    """A model folder's generation_config.json ({} without one)."""
    file = os.path.join(path, "generation_config.json")
    gen = read_json(file) if os.path.exists(file) else {}
    if not isinstance(gen, dict):
        raise ValueError(f"model folder: {file} must hold a JSON object, got {type(gen).__name__}")
    return gen


def sampling_defaults(path: str | os.PathLike) -> dict[str, Any]:
    """The SamplingParams fields a model folder's generation_config.json sets (vLLM's
    ``get_default_sampling_params``: temperature, top_p, top_k, min_p, repetition_penalty and
    max_new_tokens as max_tokens; ``do_sample`` is not read, as vLLM does not)."""
    gen = generation_config(path)
    return {ours: gen[theirs] for theirs, ours in SAMPLING_DEFAULTS.items()
            if gen.get(theirs) is not None}


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"model folder: {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"model folder: {path} is not valid JSON ({e})") from None


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [head_dim // 2], with HF's llama3 / linear scaling applied."""
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "linear":
        return inv / rs.factor
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)
