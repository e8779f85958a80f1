from __future__ import annotations

import os

import torch

# Without CUDA the Triton kernels run in its interpreter. Triton reads this when a kernel is
# decorated, so it is set before anything imports kernels/.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pulseinfer.common.model.meta import ModelLoadError, default_model_path
from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.model.loader import LoadedModel, load_model

torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model() -> LoadedModel:
    try:
        return load_model()
    except ModelLoadError as e:
        if torch.cuda.is_available():  # a GPU check's machine, where the 98 MB model file may not travel
            pytest.skip(str(e))
        raise


@pytest.fixture(scope="session")
def gemma_model() -> LoadedModel:
    """Gemma 3 270M (GGUF, Q4_K_M): sliding-window layers of 512 beside full ones."""
    return load_model("gemma-3-270m")


@pytest.fixture(scope="session")
def engine(model) -> Engine:
    return Engine(EngineConfig(), loaded=model)


@pytest.fixture(scope="session")
def hf_model():
    """HF transformers on the same GGUF, fp32: the reference for logits and tokens."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Then it",
    "def fibonacci(n):\n    ",
    "In 1905, Albert Einstein published four papers that",
    "List three colors:\n1.",
]


MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each module's time (setup, call and teardown of its tests), for the summary below."""
    module = report.nodeid.split("::")[0]
    MODULE_SECONDS[module] = MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The slowest modules, so a slow CI run says where its time went."""
    slowest = sorted(MODULE_SECONDS.items(), key=lambda item: -item[1])[:8]
    terminalreporter.write_sep("-", "slowest modules (setup + call + teardown)")
    for module, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
