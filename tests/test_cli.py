"""`pulseinfer generate` end to end, in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pulseinfer.cli", "generate", *args], capture_output=True, text=True, timeout=300)


def test_chat_capital_of_france():
    result = run_cli("--prompt", "What is the capital of France?", "--chat", "--json", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert "Paris" in out["text"]
    assert set(out) == {"text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason", "offloaded"}
    assert out["completion_tokens"] == len(out["token_ids"]) and out["finish_reason"] in ("stop", "length")


def test_prompt_file_and_length_finish(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Count: one, two, three,")
    result = run_cli("--prompt-file", str(prompt), "--max-tokens", "5", "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["completion_tokens"] == 5 and out["finish_reason"] == "length"


def _unsupported_model(tmp_path):
    path = tmp_path / "gpt2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    return path


def _unsupported_gguf(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda tmp: ["--model", str(tmp / "missing.gguf")], "model not found"),
        (lambda tmp: ["--model", str(_unsupported_model(tmp))], "unsupported architecture"),
        (lambda tmp: ["--model", str(_unsupported_gguf(tmp))], "unsupported architecture"),
        (lambda tmp: ["--max-tokens", "0"], "max_tokens must be"),
        (lambda tmp: ["--temperature", "-1"], "temperature must be"),
    ],
)
def test_bad_input_fails_clearly(tmp_path, make_args, message):
    result = run_cli("--prompt", "hi", *make_args(tmp_path))
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_prompt_longer_than_context(tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("word " * 9000)
    result = run_cli("--prompt-file", str(prompt))
    assert result.returncode != 0
    assert "context" in result.stderr and "Traceback" not in result.stderr
