"""`pulseinfer generate` and `pulseinfer eval` end to end, in a subprocess, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(*args: str, command: str = "generate") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pulseinfer.cli", *command.split(), *args], capture_output=True, text=True, timeout=300)


SMALL_SPARSE = ("--sink", "16", "--recent", "32", "--budget", "64")  # 4 of ~25 host blocks selected at 500 tokens


@pytest.mark.parametrize("mode", ["pulse", "headwise"])
def test_eval_passkey_reports_accuracy_mass_and_transfers(mode):
    result = run_cli(
        "--lengths", "500", "--depths", "0.5", "--trials", "1", "--mode", mode, *SMALL_SPARSE, "--json", command="eval passkey"
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["settings"]["mode"] == mode and out["settings"]["budget"] == 64
    (case,) = out["cases"]
    assert 450 <= case["tokens"] <= 550 and case["found"] == (str(case["key"]) in case["answer"])
    selection = out["selection"]
    assert 0 < selection["attention_mass_min"] <= selection["attention_mass"] <= 1
    assert selection["decoded_rows"] >= 1 and selection["recall_transfers_per_step"] > 0


def test_eval_ppl_dense_and_bad_settings(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(200)))
    args = ("--file", str(text), "--context", "256", "--score-tokens", "16", "--windows", "2")
    result = run_cli(*args, "--mode", "dense", "--json", command="eval ppl")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["scored_tokens"] == 32 and 1 < out["perplexity"] < 20  # repetitive text: low but not 1
    assert out["selection"]["attention_mass"] == 1.0
    bad = run_cli(*args[:2], "--context", "256", "--score-tokens", "300", command="eval ppl")
    assert bad.returncode != 0 and "--score-tokens" in bad.stderr and "Traceback" not in bad.stderr


def test_chat_capital_of_france():
    result = run_cli("--prompt", "What is the capital of France?", "--chat", "--json", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert "Paris" in out["text"]
    assert set(out) == {"text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason", "offloaded", "cached_tokens"}
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


def test_bench_decode_compares_modes_on_the_same_requests(tmp_path):
    # every request offloaded (pulse without admission) with a budget covering every host block:
    # the tokens must be dense's, and the harness must see that; two rounds, the second reversed
    out = tmp_path / "decode.json"
    result = run_cli(
        *("--requests", "2", "--context", "300-400", "--output-tokens", "4", "--device-kv-tokens", "1024", "--rounds", "2"),
        *("--sink", "16", "--recent", "64", "--budget", "512", "--modes", "dense,pulse-no-admission", "--json", str(out)),
        command="bench decode",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["settings"]["lengths"] == [300, 400]
    dense, pulse = report["modes"]
    assert dense["offloaded_requests"] == 0 and dense["recall_bytes_per_step"] == 0
    assert pulse["offloaded_requests"] == 2 and pulse["recall_bytes_per_step"] > 0
    assert pulse["agreement_with_dense"] == 1.0 and all(len(t) == 4 for t in pulse["tokens"])
    assert dense["decode_tok_s"] > 0 and dense["tpot_p50_s"] > 0 and "pulse-no-admission" in result.stdout
    order = [line.split(":")[0] for line in result.stdout.splitlines() if line.startswith("round ")]
    assert order == ["round 0, dense", "round 0, pulse-no-admission", "round 1, pulse-no-admission", "round 1, dense"]
    assert len(dense["decode_tok_s_by_round"]) == 2
    assert dense["decode_tok_s"] == pytest.approx(sum(dense["decode_tok_s_by_round"]) / 2)


def test_bench_decode_rejects_bad_settings():
    result = run_cli("--modes", "dense,fast", command="bench decode")
    assert result.returncode == 1 and "--modes takes" in result.stderr
    result = run_cli("--context", "5000-4000", command="bench decode")
    assert result.returncode == 1 and "--context" in result.stderr
