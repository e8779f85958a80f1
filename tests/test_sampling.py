import math
from array import array

import pytest
import torch

from pulseinfer.common.model.tokenizer import TextStream
from pulseinfer.gpu_worker.sampler import UNSAMPLEABLE, sample, sample_with_logprobs
from pulseinfer.messages.plan import Logprobs, SamplingSpec, TokenHistory
from pulseinfer.messages.sampling import FinishReason, SamplingParams
from pulseinfer.messages.wire import sampling_from_proto, sampling_to_proto
from pulseinfer.proto.pulseinfer.v1 import worker_pb2
from pulseinfer.scheduler.request import Sequence


def spec(**kw) -> SamplingSpec:
    base = dict(temperature=1.0, top_p=1.0, top_k=0, seed=7, step=0)
    return SamplingSpec(**{**base, **kw})


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    assert sample(logits, [spec(temperature=0.0)] * 3) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_varies_with_step():
    logits = torch.zeros(1, 1000)
    a = [sample(logits, [spec(step=s)])[0] for s in range(20)]
    b = [sample(logits, [spec(step=s)])[0] for s in range(20)]
    assert a == b
    assert len(set(a)) > 10


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(8, 100)
    greedy = logits.argmax(-1).tolist()
    assert sample(logits, [spec(top_k=1)] * 8) == greedy
    assert sample(logits * 5, [spec(top_p=1e-6)] * 8) == (logits * 5).argmax(-1).tolist()


def test_top_k_restricts_support():
    logits = torch.arange(100, dtype=torch.float32)[None]
    picks = {sample(logits / 50, [spec(top_k=3, step=s)])[0] for s in range(200)}
    assert picks <= {97, 98, 99} and len(picks) > 1


FLOAT32_DENORMAL = float(torch.tensor(1e-45, dtype=torch.float32))  # what 1e-45 becomes over gRPC


def _logits_with_masked_tokens(rows: int = 8, vocab: int = 100) -> torch.Tensor:
    logits = torch.randn(rows, vocab) * 5
    logits[:, ::7] = float("-inf")  # a model may mask tokens; no temperature may turn them into NaN
    return logits


def test_extreme_temperatures_give_valid_tokens():
    logits = _logits_with_masked_tokens()
    allowed = set(range(100)) - set(range(0, 100, 7))
    for temperature in [1e-40, FLOAT32_DENORMAL, 1e-6, 1e-5, 1e-3, 3e38, 1e300]:
        for step in range(5):
            tokens = sample(logits, [spec(temperature=temperature, step=step)] * 8)
            assert all(isinstance(t, int) and t in allowed for t in tokens), (temperature, tokens)


def test_tiny_temperature_is_greedy():
    logits = torch.randn(8, 100)
    greedy = logits.argmax(-1).tolist()
    for temperature in [1e-40, FLOAT32_DENORMAL, 1e-6]:
        assert sample(logits, [spec(temperature=temperature)] * 8) == greedy
    assert sample(logits.bfloat16(), [spec(temperature=FLOAT32_DENORMAL)] * 8) == logits.bfloat16().argmax(-1).tolist()


def test_huge_top_k_and_tiny_top_p_give_valid_tokens():
    logits = _logits_with_masked_tokens()
    for kw in [dict(top_k=100), dict(top_k=10**6), dict(top_k=2**62), dict(top_p=1e-300), dict(top_p=FLOAT32_DENORMAL)]:
        for temperature in [FLOAT32_DENORMAL, 1e-5, 1.0, 3e38]:
            tokens = sample(logits, [spec(temperature=temperature, **kw)] * 8)
            assert all(isinstance(t, int) and 0 <= t < 100 for t in tokens), (kw, temperature, tokens)
    assert sample(logits, [spec(top_p=1e-300)] * 8) == logits.argmax(-1).tolist()


def test_unsampleable_row_fails_only_itself():
    logits = torch.randn(4, 100)
    specs = [spec(temperature=0.0), spec(step=1), spec(temperature=0.7, top_k=20, step=2), spec(top_p=0.9, step=3)]
    clean = sample(logits, specs)
    one_nan = logits[1].clone()
    one_nan[5] = float("nan")
    for bad_row in [torch.full((100,), float("nan")), torch.full((100,), float("-inf")), one_nan]:
        for i in range(4):
            batch = logits.clone()
            batch[i] = bad_row
            got = sample(batch, specs)
            assert got[i] == UNSAMPLEABLE
            assert got[:i] + got[i + 1 :] == clean[:i] + clean[i + 1 :]


def test_denormal_temperature_beside_greedy_requests_leaves_them_unchanged(engine):
    prompts = [engine.tokenizer.encode(p) for p in ["The capital of France is", "1, 2, 3,", "Once upon a time"]]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    tiny = SamplingParams(max_tokens=6, temperature=FLOAT32_DENORMAL, seed=3, ignore_eos=True)
    expected = [c.token_ids for c in engine.generate(prompts, greedy)]
    together = engine.generate(prompts, [greedy, tiny, greedy])
    assert all(not c.error and c.finish_reason == "length" for c in together)
    assert [c.token_ids for c in together] == expected  # the tiny temperature is greedy, its neighbours untouched


def test_unsampleable_logits_fail_only_their_request(engine, monkeypatch):
    prompts = [engine.tokenizer.encode(p) for p in ["The capital of France is", "1, 2, 3,", "Once upon a time"]]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    params = [greedy, SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True), greedy]
    expected = engine.generate([prompts[0], prompts[2]], greedy)
    logits_of = engine.runner.model.logits
    broken: set[str] = set()

    def nan_for_broken(*args, **kwargs):
        logits = logits_of(*args, **kwargs).clone()  # an inference tensor: no in-place writes
        sampled = [c.seq_id for c in engine.last_plan.chunks if c.sampling is not None]
        for row, seq_id in enumerate(sampled):
            if seq_id in broken:
                logits[row] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner.model, "logits", nan_for_broken)
    ids = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    broken.add(ids[1])
    done = {}
    while len(done) < len(ids) or engine.batcher.released:
        done.update((c.seq_id, c) for c in engine.step())
    assert done[ids[1]].finish_reason == FinishReason.ERROR.value and done[ids[1]].error == UNSAMPLEABLE
    assert [done[ids[0]].token_ids, done[ids[2]].token_ids] == [c.token_ids for c in expected]
    assert all(not done[i].error for i in (ids[0], ids[2]))
    engine.allocator.check()


def test_logit_bias_moves_only_its_own_rows_tokens():
    """Row 0's +5 on token 3 beats its top logit by 1 (greedy takes it); row 1's -100 on its top
    token hands greedy to its second; row 2 asks nothing and keeps its argmax."""
    logits = torch.tensor([[0.0, 4.0, 1.0, 0.0], [0.0, 3.0, 2.0, 1.0], [0.0, 3.0, 2.0, 1.0]])
    specs = [spec(temperature=0.0, bias_ids=(3,), bias_values=(5.0,)), spec(temperature=0.0, bias_ids=(1,), bias_values=(-100.0,))]
    assert sample(logits, [*specs, spec(temperature=0.0)]) == [3, 2, 1]
    # sampled: a +ln(3) bias on token 0 of two equal logits makes it 3:1, as softmax says
    picks = [sample(torch.zeros(1, 2), [spec(bias_ids=(0,), bias_values=(math.log(3),), step=s)])[0] for s in range(4000)]
    assert abs(picks.count(0) / 4000 - 0.75) < 0.03


def test_min_p_keeps_tokens_at_least_min_p_times_the_likeliest():
    """Probabilities 0.5, 0.25, 0.15, 0.1: min_p 0.4 keeps tokens 0 and 1 (0.25 >= 0.2), renormalised
    to 2:1; min_p 1 keeps the likeliest alone; the row beside it without min_p keeps all four."""
    logits = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()
    picks = [sample(logits, [spec(min_p=0.4, step=s)])[0] for s in range(3000)]
    assert set(picks) == {0, 1} and abs(picks.count(0) / 3000 - 2 / 3) < 0.03
    assert {sample(logits, [spec(min_p=1.0, step=s)])[0] for s in range(200)} == {0}
    both = [sample(logits.repeat(2, 1), [spec(min_p=1.0, step=s), spec(step=s)]) for s in range(400)]
    assert {a for a, _ in both} == {0} and {b for _, b in both} == {0, 1, 2, 3}


def test_min_tokens_bans_the_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0]])  # token 2 (say eos) is greedy's
    banned = spec(temperature=0.0, min_tokens=3, stop_ids=(2,))
    assert [sample(logits, [SamplingSpec(**{**_fields(banned), "step": step})])[0] for step in range(5)] == [1, 1, 1, 2, 2]


def test_min_tokens_lets_no_stop_string_end_the_text_before_it(engine):
    tok = engine.tokenizer
    ids = tok.encode("A STOP here, STOP there", add_special=False)
    first_stop = next(i for i in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:i]))
    stream = TextStream(tok, stop=("STOP",), min_tokens=first_stop)
    out = "".join(stream.update(ids[: i + 1]) for i in range(len(ids)))
    assert stream.stopped and out == "A STOP here, "


def _fields(s: SamplingSpec) -> dict:
    return {name: getattr(s, name) for name in SamplingSpec.__slots__}


def test_sampling_params_validation():
    bad_ones = [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(stop=("",))]
    bad_ones += [dict(min_p=1.5), dict(min_p=-0.1), dict(max_tokens=4, min_tokens=5), dict(logit_bias=((1, 101.0),))]
    bad_ones += [dict(logit_bias=((100, 1.0),)), dict(logit_bias=((1, 1.0), (1, 2.0)))]
    bad_ones += [dict(logit_bias=tuple((i % 100, 0.0) for i in range(301)))]
    for bad in bad_ones:
        try:
            SamplingParams(**bad).validate(100)
        except ValueError:
            continue
        raise AssertionError(f"{bad} was accepted")


def test_text_stream_holds_back_and_cuts_at_stop_string(engine):
    tok = engine.tokenizer
    ids = tok.encode("Hello there. STOP and more")
    stream = TextStream(tok, stop=("STOP",))
    out = "".join(stream.update(ids[: i + 1]) for i in range(len(ids)))
    assert stream.stopped
    assert out == "Hello there. "
    plain = TextStream(tok)
    text = "".join(plain.update(ids[: i + 1]) for i in range(len(ids))) + plain.flush()
    assert text == "Hello there. STOP and more"
    kept = TextStream(tok, stop=("STOP", "there"), include_stop=True)
    assert "".join(kept.update(ids[: i + 1]) for i in range(len(ids))) == "Hello there"  # the first stop string, itself included


def test_text_stream_writes_special_tokens_only_when_asked(engine):
    tok = engine.tokenizer
    ids = tok.encode("Hi", add_special=False) + [tok.eos_id] + tok.encode(" you", add_special=False)
    texts = []
    for skip in (True, False):
        stream = TextStream(tok, skip_special=skip)
        texts.append("".join(stream.update(ids[: i + 1]) for i in range(len(ids))) + stream.flush())
    assert texts == ["Hi you", "Hi" + tok.decode([tok.eos_id], skip_special=False) + " you"]


def test_text_stream_never_splits_utf8(engine):
    tok = engine.tokenizer
    ids = tok.encode("東京 🚀")
    stream = TextStream(tok)
    deltas = [stream.update(ids[: i + 1]) for i in range(len(ids))]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + stream.flush() == "東京 🚀"


def test_text_stream_long_output_equals_full_decode(engine):
    import pydoc_data.topics

    tok = engine.tokenizer
    text = " ".join(list(pydoc_data.topics.topics.values())[:3]) + " naïve 東京 🚀 ok"
    ids = tok.encode(text)
    stream = TextStream(tok, context_ids=tok.encode("Context: "))
    streamed = "".join(stream.update(ids[: i + 1]) for i in range(len(ids))) + stream.flush()
    assert len(ids) > 1000 and streamed == tok.decode(ids)


def test_logprobs_are_of_the_biased_scaled_distribution_the_token_was_drawn_from():
    """Greedy rows: the log-softmax of the logits after logit_bias (unscaled); sampled rows: after
    temperature too, at the token drawn; ranks and the top alternatives of the same distribution;
    a row that asks for none gets None."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    specs = [
        spec(temperature=0.0, logprobs=True, top_logprobs=4, bias_ids=(7,), bias_values=(5.0,)),
        spec(temperature=0.5, logprobs=True, top_logprobs=0, step=3),
        spec(temperature=0.0),
    ]
    tokens, logprobs = sample_with_logprobs(logits, specs)
    assert tokens == sample(logits, specs) and logprobs[2] is None
    biased = logits[0].clone()
    biased[7] += 5.0
    greedy = torch.log_softmax(biased, -1)
    assert tokens[0] == int(greedy.argmax())
    assert logprobs[0].logprobs == pytest.approx([greedy.max().item()]) and logprobs[0].ranks == [1]
    assert logprobs[0].top_ids == greedy.topk(4).indices.tolist() and logprobs[0].top_logprobs == pytest.approx(
        greedy.topk(4).values.tolist()
    )
    hot = torch.log_softmax(logits[1] / 0.5, -1)
    assert logprobs[1].logprobs == pytest.approx([hot[tokens[1]].item()]) and logprobs[1].top_ids == []
    assert logprobs[1].ranks == [int((hot > hot[tokens[1]]).sum()) + 1]


def test_prompt_logprobs_are_reported_once_per_position_across_chunks_and_a_restart():
    """A prompt scored in two chunks, then again from position 0 after a preemption: every position
    1..len-1 reported once, in order, and nothing past the prompt."""
    seq = Sequence.admit("a", range(1, 11), SamplingParams(prompt_logprobs=0), vocab_size=100)

    def scored(start: int, count: int) -> Logprobs:  # positions start + 1 .. start + count, as logprob -position
        return Logprobs([-float(p) for p in range(start + 1, start + 1 + count)], [1] * count, 0, [], [])

    assert seq.scores_prompt
    assert seq.take_prompt_logprobs(0, scored(0, 4)).logprobs == [-1, -2, -3, -4]
    assert seq.take_prompt_logprobs(0, scored(0, 6)).logprobs == [-5, -6]  # preempted: scored again from 0
    assert seq.take_prompt_logprobs(6, scored(6, 3)).logprobs == [-7, -8, -9]  # the chunk that samples
    assert not seq.scores_prompt and len(seq.take_prompt_logprobs(6, scored(6, 4))) == 0


def penalized(prompt=(), outputs=(), presence=0.0, frequency=0.0, repetition=1.0, **kw) -> SamplingSpec:
    history = TokenHistory(tuple(prompt), array("q", outputs))
    return spec(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition, history=history, **kw)


def test_penalties_are_vllms_formulas_and_touch_only_their_row():
    """Logits (2, 1, -1, 0.5, 0), prompt (2,), outputs (1, 1, 3), repetition 2, frequency 0.25,
    presence 0.5. By hand: token 0 unseen stays 2; token 1 (twice) 1/2 - 0.25*2 - 0.5 = -0.5; token 2
    (prompt only, negative) -1*2 = -2; token 3 (once) 0.5/2 - 0.25 - 0.5 = -0.5; token 4 unseen 0.
    The greedy logprobs report the penalized log-softmax; the row beside it has the raw one."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0]]).repeat(2, 1)
    specs = [
        penalized((2,), (1, 1, 3), 0.5, 0.25, 2.0, temperature=0.0, logprobs=True, top_logprobs=5),
        spec(temperature=0.0, logprobs=True, top_logprobs=5),
    ]
    _, (mine, neighbour) = sample_with_logprobs(logits, specs)
    for report, row in ((mine, [2.0, -0.5, -2.0, -0.5, 0.0]), (neighbour, [2.0, 1.0, -1.0, 0.5, 0.0])):
        expected = torch.log_softmax(torch.tensor(row), dim=-1)
        assert dict(zip(report.top_ids, report.top_logprobs)) == pytest.approx(dict(enumerate(expected.tolist())), abs=1e-6)


def test_penalties_follow_a_growing_history_and_a_wire_round_trip():
    """Logits (3, 2.5): presence 1 moves greedy off token 0 once it has been sampled, frequency 0.3
    only after it has been sampled twice (3 - 0.6 < 2.5); a repetition penalty of 1.25 turns a
    prompt token's 3 into 2.4. The history sent to a worker (a re-admission's) keeps what it had."""
    logits = torch.tensor([[3.0, 2.5]])
    presence = penalized(presence=1.0, temperature=0.0)
    assert sample(logits, [presence]) == [0]
    presence.history.outputs.append(0)
    assert sample(logits, [presence.next()]) == [1]
    frequency = penalized(frequency=0.3, temperature=0.0)
    for expected in (0, 0, 1):
        (token,) = sample(logits, [frequency])
        assert token == expected
        frequency.history.outputs.append(token)
    assert sample(logits, [penalized(prompt=(0,), repetition=1.25, temperature=0.0)]) == [1]
    assert sample(logits, [penalized(prompt=(0,), repetition=1.1, temperature=0.0)]) == [0]  # 3 / 1.1 > 2.5
    sent = sampling_from_proto(worker_pb2.SamplingSpec.FromString(sampling_to_proto(frequency).SerializeToString()))
    assert (sent.history.prompt, list(sent.history.outputs)) == ((), [0, 0, 1]) and sent.frequency_penalty == pytest.approx(0.3)
    assert sampling_from_proto(sampling_to_proto(spec())).history is None


def test_a_batch_samples_each_row_as_it_would_alone():
    """The batched distributions: rows with different temperature, top-k, top-p, min-p and penalties
    draw, in one batch, the tokens each draws alone."""
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    rows = [
        dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.05),
        dict(temperature=0.0), dict(temperature=1.0, top_k=40, top_p=0.9, min_p=0.01),
    ]  # fmt: skip
    for step in range(40):
        specs = [spec(step=step, **row) for row in rows]
        specs[1] = penalized(outputs=(3, 3, 7), presence=0.5, frequency=0.5, step=step, temperature=1.3, top_p=0.8)
        alone = [sample(logits[i : i + 1], [s])[0] for i, s in enumerate(specs)]
        assert sample(logits, specs) == alone
