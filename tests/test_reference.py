"""The engine against HF transformers loading the same GGUF in fp32."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import PROMPTS
from helpers import last_logits

from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.model.loader import load_model, save_hf_dir
from pulseinfer.gpu_worker.runner import ModelRunner
from pulseinfer.messages.sampling import SamplingParams


def _long_prompt(tokenizer, n_tokens: int) -> list[int]:
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics.values())
    ids = tokenizer.encode(text)
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


def test_tokenizer_matches_hf(engine, hf_tokenizer):
    texts = [*PROMPTS, "naïve café 東京 🚀 12345 ", "  multiple   spaces\n\ttabs", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert engine.tokenizer.encode(text) == hf_tokenizer.encode(text), text
        ids = engine.tokenizer.encode(text)
        assert engine.tokenizer.decode(ids, skip_special=False) == hf_tokenizer.decode(ids)


def test_chat_template_matches_hf(engine, hf_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert engine.tokenizer.render_chat(messages) == expected


def test_greedy_tokens_match_hf(engine, hf_model):
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    ours = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, completion in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert completion.token_ids == ref[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def long_ids(engine):
    return _long_prompt(engine.tokenizer, 1024)


@pytest.fixture(scope="module")
def hf_long_logits(hf_model, long_ids):
    with torch.inference_mode():
        return hf_model(torch.tensor([long_ids])).logits[0, -1].float()


def test_logits_match_hf_on_1k_prompt(engine, long_ids, hf_long_logits):
    ours = last_logits(engine.runner, long_ids)
    assert (ours - hf_long_logits).abs().max().item() < 1e-3


def test_chunked_prefill_matches_one_pass(engine, long_ids, hf_long_logits):
    chunked = last_logits(engine.runner, long_ids, chunk=300)
    assert (chunked - hf_long_logits).abs().max().item() < 1e-3


def test_safetensors_dir_from_gguf_gives_same_logits(model, engine, long_ids, tmp_path):
    save_hf_dir(model, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    reloaded = load_model(tmp_path / "hf")
    assert reloaded.config == model.config
    assert reloaded.tokenizer.encode(PROMPTS[0]) == model.tokenizer.encode(PROMPTS[0])
    runner = ModelRunner(reloaded, WorkerConfig(device_kv_tokens=2048))
    ids = long_ids[:256]
    # same weights; fp32 GEMM results may differ in the last bits with memory alignment
    assert (last_logits(runner, ids) - last_logits(engine.runner, ids)).abs().max().item() < 1e-4


def test_teacher_forced_scores_match_hf(engine, long_ids, hf_model):
    """Engine.score (the perplexity eval) decodes the last tokens one step each, feeding the text's own tokens."""
    ids = long_ids[:400]
    (ours,) = engine.score([ids], 24)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [ref[pos - 1, ids[pos]].item() for pos in range(len(ids) - 24, len(ids))]
    assert len(ours) == 24
    assert max(abs(a - b) for a, b in zip(ours, expected)) < 1e-3
