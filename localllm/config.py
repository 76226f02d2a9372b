"""Model configuration, read from a checkpoint's config.json (Llama family only)."""
from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields

import torch

from .errors import LocalLLMError, is_real

# model_type -> whether q/k/v carry a bias. Everything else about these is the same Llama block.
SUPPORTED = {"llama": False, "mistral": False, "qwen2": True}
# keys a config.json may leave out, which then take their architecture's default in transformers (not one of ours:
# a Mistral without sliding_window slides at 4096, a Llama without rms_norm_eps has 1e-6)
DEFAULTED = ("rms_norm_eps", "max_position_embeddings", "sliding_window", "use_sliding_window", "max_window_layers",
             "hidden_act")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "llama3"|"linear", ...} or {}
    max_position_embeddings: int = 4096
    sliding_window: int = 0  # the attention window where it set max_position_embeddings (0: it did not)
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "llama"

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face config dict (config.json or a transformers config's to_dict())."""
        mt = cfg.get("model_type")
        if mt is None:
            raise LocalLLMError("config.json has no model_type: the checkpoint's config is incomplete; re-download "
                                "it (localllm runs model_type llama, mistral and qwen2)")
        if mt not in SUPPORTED:
            archs = ", ".join(cfg.get("architectures") or [str(mt)])
            raise LocalLLMError(
                f"unsupported architecture '{archs}': localllm runs Llama-family models "
                f"(model_type llama, mistral, qwen2); pick a Llama/Mistral/Qwen2/SmolLM checkpoint")
        # Llama's attention_bias also puts a bias on o_proj, and mlp_bias on gate, up and down: biases the low-bit
        # layers here do not add (Qwen2's q, k and v biases they do)
        unsupported = [flag for flag in ("attention_bias", "mlp_bias") if mt == "llama" and cfg.get(flag)]
        if unsupported:
            raise LocalLLMError(f"unsupported Llama variant ({' and '.join(unsupported)} true: biases on o_proj or the "
                                "MLP, which localllm does not run); pick a checkpoint without them")
        cfg = {**_hf_defaults(mt), **cfg}
        if cfg.get("hidden_act") not in ("silu", "swish"):  # swish is silu
            raise LocalLLMError(f"unsupported activation '{cfg.get('hidden_act')}' (hidden_act): localllm runs the "
                                "SwiGLU MLP of Llama-family models (silu); pick a checkpoint with hidden_act silu")
        try:
            heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
            rope_type = rope.get("rope_type") or rope.get("type") or "default"
            native = rope.get("original_max_position_embeddings")
            if rope_type == "dynamic":  # dynamic NTK is the default RoPE up to max_position_embeddings (transformers
                # reads no original_max_position_embeddings for it): run it there
                rope_type, cap = "default", cfg["max_position_embeddings"]
            else:
                cap = None
            if not (isinstance(heads, int) and heads > 0):
                raise LocalLLMError(f"config.json's num_attention_heads is {heads!r}: the checkpoint's config is "
                                    "damaged; re-download it")
            head_dim = cfg.get("head_dim") or hidden // heads
            if rope_type == "factors" and not _factors_fit(rope.get("factors"), head_dim):
                rope_type = "factors (without a list of head_dim / 2 numbers)"  # only a GGUF's rope_freqs make one
            if rope_type not in ("default", "llama3", "linear", "factors"):  # factors: a GGUF's rope_freqs
                raise LocalLLMError(
                    f"unsupported RoPE scaling '{rope_type}': localllm supports default, linear, llama3 and dynamic "
                    + ("RoPE; in config.json set rope_parameters' rope_type to \"default\" (keep its rope_theta)"
                       if cfg.get("rope_parameters") else "RoPE; remove rope_scaling from config.json")
                    + (f" and set max_position_embeddings to {native}" if native else "")
                    + " to run the model at its native context")
            rope = {} if rope_type == "default" else {**rope, "rope_type": rope_type}
            if rope_type == "llama3":  # as transformers fills it in
                rope.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
            # (Llama's default is one kv head per head, Mistral's 8, Qwen2's 32, whatever the heads)
            kv_heads = cfg.get("num_key_value_heads") or _hf_kv_heads(mt, heads)
            if kv_heads < 1 or heads % kv_heads:
                raise LocalLLMError(f"config.json's num_attention_heads ({heads}) is not a multiple of "
                                    f"num_key_value_heads ({kv_heads}): the checkpoint's config is damaged; "
                                    "re-download it")
            max_pos = min(cfg["max_position_embeddings"], cap or cfg["max_position_embeddings"])
            # sliding-window attention only differs past the window: the context ends there
            window = cfg["sliding_window"] if _slides(mt, cfg) and cfg["sliding_window"] < max_pos else 0
            max_pos = window or max_pos
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=cfg["rms_norm_eps"],
                rope_theta=float(theta),
                rope_scaling=rope,
                max_position_embeddings=max_pos,
                sliding_window=window,
                qkv_bias=SUPPORTED[mt],
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                model_type=mt,
            )
        except KeyError as e:
            raise LocalLLMError(f"config.json is missing '{e.args[0]}': the checkpoint is incomplete or not a "
                                "Llama-family model; re-download it") from None

    @property
    def context(self) -> str:
        """The context for messages: its length, and why where the attention window set it."""
        why = " (its sliding-window attention's window: localllm does not attend past it)" \
            if self.sliding_window else ""
        return f"{self.max_position_embeddings}{why}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """A config that to_dict() wrote (a model file's manifest)."""
        names = {f.name for f in fields(cls)}
        if set(d) - names or any(f.name not in d for f in fields(cls) if f.default is MISSING and
                                 f.default_factory is MISSING) or d.get("model_type", "llama") not in SUPPORTED:
            raise LocalLLMError(f"the model's config ({', '.join(sorted(set(d) ^ names)) or d.get('model_type')}) is "
                                "not one this localllm writes: upgrade localllm, or re-run `localllm quantize`")
        return cls(**d)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_weights(self) -> int:
        """Weights of the blocks' projections (q, k, v, o, gate, up, down): what the low-bit layers hold."""
        d, i, qkv = self.hidden_size, self.intermediate_size, self.q_size + 2 * self.kv_size
        return self.num_layers * (d * qkv + self.q_size * d + 3 * d * i)

    @property
    def parameters(self) -> int:
        """The checkpoint's weights: embeddings, the head unless tied, each block's projections, biases and norms."""
        d, qkv = self.hidden_size, self.q_size + 2 * self.kv_size
        per_block = 2 * d + (qkv if self.qkv_bias else 0)  # norms, biases
        return self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + self.linear_weights + \
            self.num_layers * per_block + d


def _hf_defaults(model_type: str) -> dict:
    """transformers' defaults of DEFAULTED for a model type."""
    from transformers import AutoConfig
    d = AutoConfig.for_model(model_type).to_dict()
    return {k: d[k] for k in DEFAULTED if k in d}


def _hf_kv_heads(model_type: str, heads: int) -> int:
    """transformers' num_key_value_heads for a config that leaves it out."""
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, num_attention_heads=heads).num_key_value_heads


def _factors_fit(factors, head_dim: int) -> bool:
    """Whether `factors` is what a GGUF's rope_freqs gives: one positive number per rotated pair of a head."""
    return isinstance(factors, list) and len(factors) == head_dim // 2 and all(
        is_real(f) and f > 0 for f in factors)


def _slides(model_type: str, cfg: dict) -> bool:
    """Whether some layer attends over a sliding window (cfg with DEFAULTED filled in): Mistral's every layer where
    sliding_window is set; Qwen2's layers from max_window_layers on where use_sliding_window (or layer_types) says."""
    if not cfg.get("sliding_window"):
        return False
    if cfg.get("layer_types"):
        return "sliding_attention" in cfg["layer_types"]
    if model_type == "qwen2":
        return bool(cfg.get("use_sliding_window")) and cfg.get("max_window_layers", 0) < cfg["num_hidden_layers"]
    return model_type == "mistral"


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2], float32, with Llama-3, linear or a GGUF's per-frequency scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    kind = s.get("rope_type")
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "factors":  # llama.cpp's rope_freqs: each frequency divided by its own factor
        inv = inv / torch.tensor(s["factors"], dtype=torch.float64)
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
        factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_ctx = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        blend = ((old_ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)
        inv = torch.where(wavelen > old_ctx / lo, inv / factor,
                          torch.where(wavelen < old_ctx / hi, inv, (1 - blend) * inv / factor + blend * inv))
    return inv.float()
