import torch

from gpu_worker.sampler import sample
from gpu_worker.tokenizer import TextStream
from scheduler.plan import SamplingSpec
from scheduler.request import SamplingParams


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


def test_sampling_params_validation():
    for bad in [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(stop=("",))]:
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
