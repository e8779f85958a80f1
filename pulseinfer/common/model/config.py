"""A model's geometry and the switches of its family's math, read from config.json or GGUF
metadata by meta.py. Numbers only: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one kind of layer, as transformers' rope_parameters give it."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 0  # llama3, yarn: the context the model was pretrained at
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos/sin scale; None: 0.1 ln(factor) + 1
    truncate: bool = True  # yarn: round the correction range to whole dimensions

    def to_hf_dict(self) -> dict:
        out: dict = {"rope_type": self.kind, "rope_theta": self.theta}
        if self.kind != "default":
            out["factor"] = self.factor
        if self.kind == "llama3":
            out |= {"low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor}
        if self.kind in ("llama3", "yarn"):
            out["original_max_position_embeddings"] = self.original_max_position
        if self.kind == "yarn":
            out |= {"beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "truncate": self.truncate}
            if self.attention_factor is not None:
                out["attention_factor"] = self.attention_factor
        return out


# model_type -> Hugging Face architecture class
HF_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a key of HF_ARCHITECTURE
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    rope: RopeConfig = field(default_factory=RopeConfig)  # full-attention layers' rotary embedding
    local_rope: RopeConfig | None = None  # sliding-window layers' (Gemma 3: its own base); None: `rope`
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer; empty: every layer FULL
    sliding_window: int = 0  # tokens a sliding layer's query sees, itself included
    query_pre_attn_scalar: float = 0.0  # Gemma 3 scales scores by this ** -0.5; 0: head_dim ** -0.5

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.num_layers}")
        if SLIDING in self.layer_types and self.sliding_window <= 0:
            raise ValueError("sliding-window layers need a positive sliding_window")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gemma(self) -> bool:
        """Gemma's math: scaled embeddings, (1 + w) norms around attention and MLP, GELU-tanh MLP."""
        return self.architecture == "gemma3"

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)."""
        return self.architecture in ("qwen3", "gemma3")

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @property
    def full_layers(self) -> tuple[int, ...]:
        """The layers whose whole context is kept: the paged cache's, the only ones offloaded and recalled."""
        return tuple(i for i in range(self.num_layers) if not self.sliding(i))

    @property
    def kv_layers(self) -> int:
        return len(self.full_layers)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Layers that keep only their window of K/V on the device."""
        return tuple(i for i in range(self.num_layers) if self.sliding(i))

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def to_hf_dict(self) -> dict:
        """config.json in the Hugging Face format (transformers 5's rope_parameters) of the same architecture."""
        rope: dict = self.rope.to_hf_dict()
        if self.architecture == "gemma3":
            rope = {FULL: rope, SLIDING: (self.local_rope or self.rope).to_hf_dict()}
        out = {
            "architectures": [HF_ARCHITECTURE[self.architecture]],
            "model_type": "gemma3_text" if self.architecture == "gemma3" else self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position,
            "rope_parameters": rope,
            "rms_norm_eps": self.rms_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.qkv_bias,
            "torch_dtype": "float32",
        }
        # Gemma's config names its activation hidden_activation
        out |= {"hidden_activation": "gelu_pytorch_tanh"} if self.gemma else {"hidden_act": "silu"}
        if self.layer_types:
            out |= {"layer_types": list(self.layer_types), "sliding_window": self.sliding_window}
        elif self.architecture in ("mistral", "gemma3"):
            out["sliding_window"] = None
        if self.query_pre_attn_scalar:
            out["query_pre_attn_scalar"] = self.query_pre_attn_scalar
        return out
