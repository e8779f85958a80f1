"""Each supported family against transformers: a tiny model built from a config (random weights, no
download), saved as safetensors, loaded by the engine; prefill and batched paged decode logits
compared with transformers' on the same token ids (teacher-forced)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pulseinfer.common.model.meta import ModelLoadError, hf_dir_config
from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.attention import paged, window
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.model.loader import load_model
from pulseinfer.gpu_worker.offload.config import OffloadConfig
from pulseinfer.kernels.decode_triton import paged_decode_attention_triton
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.scheduler.batcher import BatcherConfig

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
SLIDING, FULL = "sliding_attention", "full_attention"
FAMILIES = {
    # Llama 3.1-style scaling, pretraining context short enough that our positions cross its bands
    "llama": lambda v: transformers.LlamaConfig(
        vocab_size=v,
        num_hidden_layers=3,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        **SMALL,
    ),
    "qwen2": lambda v: transformers.Qwen2Config(
        vocab_size=v,
        num_hidden_layers=3,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64},
        **SMALL,
    ),
    "qwen3": lambda v: transformers.Qwen3Config(
        vocab_size=v,
        num_hidden_layers=3,
        head_dim=32,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        **SMALL,
    ),
    # windowed on every layer (transformers' Mistral default is 4096; 48 is crossed by the prompts)
    "mistral": lambda v: transformers.MistralConfig(vocab_size=v, num_hidden_layers=2, sliding_window=48, rope_theta=1e6, **SMALL),
    "gemma3": lambda v: transformers.Gemma3TextConfig(
        vocab_size=v,
        num_hidden_layers=6,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=16,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
        **SMALL,
    ),
}
PROMPT_LENGTHS = (40, 75, 130)
FORCED = 6  # decode steps, each teacher-forced


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("tokenizer")
    model.tokenizer.save_hf_dir(path)
    return path


def _tiny(family: str, vocab: int, tokenizer_dir, tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](vocab), attn_implementation="eager").float().eval()
    with torch.no_grad():  # transformers zero-initializes Gemma's norms; random ones test the (1 + w)
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.normal_(0.0, 0.3 if family == "gemma3" else 0.1).add_(0.0 if family == "gemma3" else 1.0)
    path = tmp_path / family
    hf.save_pretrained(path)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    return hf, path


def _texts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n + FORCED,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _engine_logits(engine: Engine, texts: list[list[int]]) -> dict[int, list[torch.Tensor]]:
    """Our logits at each text's last prompt position and after each forced token, all texts batched."""
    seqs = {engine.submit(text[:-FORCED], SamplingParams(max_tokens=FORCED, ignore_eos=True)): i for i, text in enumerate(texts)}
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in seqs.values()}

    def force(rows: torch.Tensor, chunks) -> list[int]:
        tokens = []
        for row, chunk in zip(rows, chunks):
            i = seqs[chunk.seq_id]
            logits[i].append(row.clone())
            tokens.append(texts[i][len(texts[i]) - FORCED + len(logits[i]) - 1])
        return tokens

    while any(len(rows) < FORCED for rows in logits.values()) or engine.batcher.has_work():
        engine.step(force)
    return logits


def _small_engine(path, mode: str = "dense", budget: int = 0) -> Engine:
    offload = OffloadConfig(sink=16, recent=32, budget=budget or 16, calibration_tokens=256, key_rank=8)
    return Engine(
        EngineConfig(
            model=str(path),
            worker=WorkerConfig(mode=mode, device_kv_tokens=4096, offload=offload, max_running=4),
            batcher=BatcherConfig(prefill_chunk=32, offload="never" if mode == "dense" else "always"),
            host_kv_tokens=4096,
        )
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_and_batched_decode_logits_match_transformers(family, model, tokenizer_dir, tmp_path):
    vocab = model.config.vocab_size
    hf, path = _tiny(family, vocab, tokenizer_dir, tmp_path)
    engine = _small_engine(path)
    texts = _texts(vocab)
    ours = _engine_logits(engine, texts)
    for i, text in enumerate(texts):
        with torch.inference_mode():
            ref = hf(torch.tensor([text])).logits[0, len(text) - FORCED - 1 : len(text) - 1]
        torch.testing.assert_close(torch.stack(ours[i]), ref, atol=2e-4, rtol=1e-4)


def test_decode_kernel_in_the_forward_matches_transformers(model, tokenizer_dir, tmp_path, monkeypatch):
    """The Triton decode kernel (the interpreter's, on the CPU) where CUDA dispatches it, with the
    same arguments: Mistral's sliding layers over their rings (a window of 48, crossed)."""
    for module in (paged, window):
        monkeypatch.setattr(module, "decode_attention", paged_decode_attention_triton)
    test_prefill_and_batched_decode_logits_match_transformers("mistral", model, tokenizer_dir, tmp_path)


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
@pytest.mark.parametrize("mode", ["pulse", "headwise"])
def test_sparse_modes_at_a_covering_budget_give_dense_tokens(family, mode, model, tokenizer_dir, tmp_path):
    """Every host block selected: sparse attention is dense attention, token for token."""
    _, path = _tiny(family, model.config.vocab_size, tokenizer_dir, tmp_path)
    prompts = [text[:-FORCED] for text in _texts(model.config.vocab_size)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    dense = _small_engine(path).generate(prompts, params)
    sparse = _small_engine(path, mode, budget=256).generate(prompts, params)
    assert all(c.offloaded for c in sparse)
    assert [c.token_ids for c in sparse] == [c.token_ids for c in dense]


# ---------------------------------------------------------------- config.json dialects and errors


def _as_transformers4(config: dict) -> dict:
    """The same config as transformers 4.x wrote it: top-level rope_theta / rope_scaling (Gemma 3:
    rope_local_base_freq)."""
    out = {k: v for k, v in config.items() if k != "rope_parameters"}
    params = config["rope_parameters"]
    if FULL in params:
        out["rope_local_base_freq"] = params[SLIDING]["rope_theta"]
        params = params[FULL]
    out["rope_theta"] = params["rope_theta"]
    if params.get("rope_type", "default") != "default":
        out["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in params.items() if k != "rope_theta"}
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_both_config_dialects_give_the_same_math(family, tmp_path):
    config = FAMILIES[family](1000)
    new = config.to_dict() | {"architectures": [transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__]}
    (tmp_path / "v5").mkdir()
    (tmp_path / "v4").mkdir()
    (tmp_path / "v5" / "config.json").write_text(json.dumps(new))
    (tmp_path / "v4" / "config.json").write_text(json.dumps(_as_transformers4(new)))
    v5, v4 = hf_dir_config(tmp_path / "v5"), hf_dir_config(tmp_path / "v4")
    assert v4 == v5
    assert v5.rope.theta == (1e6 if family != "llama" else 500000.0)


def _write_config(tmp_path, **changes) -> None:
    config = FAMILIES["llama"](1000).to_dict() | {"architectures": ["LlamaForCausalLM"]} | changes
    (tmp_path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"architectures": ["Phi3ForCausalLM"]}, "unsupported architecture"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type 'longrope'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "activation 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_configs_that_change_the_math_unsupported_are_refused(changes, message, tmp_path):
    _write_config(tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=message):
        hf_dir_config(tmp_path)


def test_qwen3_without_qk_norm_weights_is_refused(model, tokenizer_dir, tmp_path):
    _, path = _tiny("qwen3", model.config.vocab_size, tokenizer_dir, tmp_path)
    weights = {k: v for k, v in load_file(path / "model.safetensors").items() if "_norm" not in k.split(".")[-2]}
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="q_norm"):
        load_model(path)


def test_weights_the_config_does_not_use_are_refused(model, tokenizer_dir, tmp_path):
    """A Qwen3 checkpoint under a Qwen2 config would lose its q/k norms without a word."""
    _, path = _tiny("qwen3", model.config.vocab_size, tokenizer_dir, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen2ForCausalLM"], "attention_bias": False}))
    with pytest.raises(ModelLoadError, match="does not use"):
        load_model(path)


def test_sliding_window_rings_cap_running_requests_and_come_back(model, tokenizer_dir, tmp_path):
    """Two rings for six requests: the scheduler runs two at a time; a pool too small for them
    preempts (the ring is freed and the request starts again); every ring is free at the end, and
    the tokens are those of a worker with a ring for each. The prompts come twice and windows of 16
    are crossed: rings are rebuilt from the sliding layers' history of cached prefixes."""
    _, path = _tiny("gemma3", model.config.vocab_size, tokenizer_dir, tmp_path)
    prompts = [text[:-FORCED] for text in _texts(model.config.vocab_size)] * 2
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = Engine(EngineConfig(model=str(path), worker=WorkerConfig(mode="dense", device_kv_tokens=4096, max_running=8)))
    expected = [c.token_ids for c in roomy.generate(prompts, params)]
    tight = Engine(
        EngineConfig(
            model=str(path),
            worker=WorkerConfig(mode="dense", device_kv_tokens=192, max_running=2),
            batcher=BatcherConfig(prefill_chunk=32),
        )
    )
    ids = [tight.submit(p, params) for p in prompts]
    done, running = {}, []
    while tight.batcher.has_work():
        done |= {c.seq_id: c for c in tight.step()}
        running.append(len(tight.batcher.running))
    assert max(running) == 2 and tight.batcher.num_preemptions > 0
    assert len(tight.runner.window.free) == 2 and not tight.runner.window.rings and tight.runner.window.rebuilt > 0
    assert [done[i].token_ids for i in ids] == expected
