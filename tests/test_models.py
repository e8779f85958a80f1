"""The models the set-up installs and the dummy geometries: Gemma 3 270M (GGUF, Q4_K_M) against
transformers loading the same file; a Qwen3-0.6B geometry with seeded random weights served by
`pulseinfer serve` to the official openai client."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
import torch
from serving_cluster import ServingCluster

from pulseinfer.common.model.meta import GEOMETRIES, ModelLoadError, gemma3_270m_path, hf_dir_config, load_model_meta
from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_check.fixtures import tiny
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.model.loader import DummyWeights, load_model, weight_shapes
from pulseinfer.messages.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gemma(gemma_model) -> Engine:
    return Engine(EngineConfig(worker=WorkerConfig(mode="dense", max_running=4, device_kv_tokens=8192)), loaded=gemma_model)


def _prose(tokenizer, n_tokens: int, offset: int) -> list[int]:
    import pydoc_data.topics

    ids = tokenizer.encode(" ".join(pydoc_data.topics.topics.values()), add_special=False)
    return [tokenizer.special.bos_id, *ids[offset : offset + n_tokens - 1]]


def test_gemma3_270m_greedy_tokens_equal_transformers(gemma):
    """A short prompt and one of 1k tokens, decoded together by the engine (sliding windows of 512
    crossed) and one by one by transformers on the same GGUF."""
    path = gemma3_270m_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [gemma.tokenizer.encode("The capital of France is"), _prose(gemma.tokenizer, 1000, 5000)]
    ours = gemma.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for prompt, completion in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert completion.token_ids == ref[0, len(prompt) :].tolist()


def test_gemma3_270m_geometry(gemma):
    c = gemma.loaded.config
    assert (c.architecture, c.num_layers, c.num_kv_heads, c.head_dim, c.sliding_window, c.max_position) == (
        "gemma3",
        18,
        1,
        256,
        512,
        32768,
    )
    assert c.full_layers == (5, 11, 17)
    # only the full layers' KV is paged (and offloaded); each running request holds a window ring per sliding layer
    assert gemma.runner.cache.shape.num_layers == 3
    assert gemma.runner.window.k.shape == (15, 4 * 512, 1, 256)


@pytest.mark.parametrize("name", sorted(p.name for p in GEOMETRIES.iterdir()))
def test_shipped_geometries_read(name):
    config = hf_dir_config(GEOMETRIES / name)
    params = sum(torch.Size(shape).numel() for shape in weight_shapes(config).values())
    expected = {
        "llama-3.1-8b": 8.03e9,
        "qwen3-0.6b": 0.596e9,
        "qwen3-8b": 8.19e9,
        "qwen3-14b": 14.77e9,
        "qwen2.5-7b": 7.62e9,
        "gemma-3-4b": 3.88e9,  # the text model of Gemma 3 4B (its 4.3B count includes the vision tower)
    }[name]
    assert abs(params / expected - 1) < 0.01, params


def test_dummy_weights_are_seeded_and_shaped():
    config = hf_dir_config(GEOMETRIES / "qwen3-0.6b")
    a, b = DummyWeights(config), DummyWeights(config)
    name = "model.layers.3.self_attn.q_proj.weight"
    assert a[name].shape == (2048, 1024)
    assert torch.equal(a[name], b[name])
    assert not torch.equal(a[name], a["model.layers.4.self_attn.q_proj.weight"])
    assert torch.equal(a["model.layers.0.self_attn.q_norm.weight"], torch.ones(128))


def test_a_geometry_without_dummy_says_how():
    with pytest.raises(ModelLoadError, match="--load-format dummy"):
        load_model("qwen3-0.6b")
    with pytest.raises(ModelLoadError, match="--load-format must be"):
        load_model_meta("qwen3-0.6b", "random")


@pytest.fixture(scope="module")
def dummy_cluster():
    cluster = ServingCluster(
        "--model",
        "qwen3-0.6b",
        "--load-format",
        "dummy",
        "--device-kv-tokens",
        "8192",
        "--host-kv-tokens",
        "8192",
        "--calibration-tokens",
        "256",
    )
    yield cluster
    assert cluster.stop() == 0


def test_dummy_qwen3_geometry_serves_the_openai_client(dummy_cluster):
    client = openai.OpenAI(base_url=dummy_cluster.base_url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["qwen3-0.6b"]
    prompt = "Seeded random weights still decode:"
    got = client.completions.create(model="qwen3-0.6b", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 6 and got.choices[0].finish_reason == "length"
    streamed = client.chat.completions.create(
        model="qwen3-0.6b", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True, extra_body={"ignore_eos": True}
    )
    assert sum(1 for chunk in streamed if chunk.choices and chunk.choices[0].delta.content is not None) >= 1
    # the same seeded weights in this process decode the same tokens
    engine = Engine(EngineConfig(model="qwen3-0.6b", load_format="dummy", worker=WorkerConfig(mode="dense", device_kv_tokens=4096)))
    (expected,) = engine.generate([engine.tokenizer.encode(prompt)], SamplingParams(max_tokens=6, ignore_eos=True))
    assert got.choices[0].text == expected.text
    status, body = dummy_cluster.http("/metrics", None, {}, None)
    assert status == 200 and b"pulseinfer:" in body


def test_kv_pools_the_machine_cannot_hold_are_refused_naming_their_flag(tmp_path):
    """A pool larger than the free memory is refused at start-up with its flag, in process and in
    the kv_store, rather than failing in mmap or being killed by the OOM killer mid-request."""
    config = json.loads((GEOMETRIES / "qwen3-0.6b" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(tiny(config)))
    huge = 1 << 40  # tokens: 512 TiB of KV at 512 B a token
    with pytest.raises(ValueError, match=r"the host KV pool of \d+ tokens \(--host-kv-tokens\) needs .* GiB, cpu memory has"):
        Engine(EngineConfig(model=str(tmp_path), load_format="dummy", host_kv_tokens=huge))
    with pytest.raises(ValueError, match=r"the device KV pool of \d+ tokens \(--device-kv-tokens\) needs"):
        Engine(EngineConfig(model=str(tmp_path), load_format="dummy", worker=WorkerConfig(mode="dense", device_kv_tokens=huge)))
    flags = ["--model", str(tmp_path), "--load-format", "dummy", "--host-kv-tokens", str(huge), "--bind", f"ipc://{tmp_path}/kv"]
    done = subprocess.run([sys.executable, "-m", "pulseinfer.kv_store", *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "(--host-kv-tokens) needs" in done.stderr and "shared memory" in done.stderr, done.stderr[-2000:]
