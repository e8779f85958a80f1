"""Structured outputs (pulseinfer.common.grammar) with the default model's tokenizer: walks driven
by random logits through fill_masks and masked end in text their grammar accepts, batched as the
worker batches rows; bad constraints are refused with a message; masking touches only its rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from pulseinfer.common.grammar import (
    GRAMMAR_KINDS,
    GrammarMatcher,
    GrammarTokenizer,
    fill_masks,
    grammar_text,
    grammars_built_aside,
    masked,
    structured_grammar,
)
from pulseinfer.common.model.meta import ModelLoadError, ModelMeta, load_model_meta

SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())
BATCH = 32  # rows per fill_masks call, as a worker's step batches them
MAX_TOKENS = 120  # every schema bounds its strings and arrays: a walk longer than this is a bug
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
EMAIL = r"[a-z][a-z0-9.]{0,7}@[a-z]{1,8}\.(com|org|net)"
CHOICES = ["yes", "no", "maybe so"]
# a tiny arithmetic grammar, bounded (no recursion) so that every walk ends
ARITHMETIC = r"""
start: term (OP term)?
term: NUMBER | "(" NUMBER OP NUMBER ")"
OP: "+" | "-" | "*" | "/"
NUMBER: /[0-9]{1,3}/
"""
_TERM = r"([0-9]{1,3}|\([0-9]{1,3}[-+*/][0-9]{1,3}\))"
ARITHMETIC_TEXT = rf"{_TERM}([-+*/]{_TERM})?"


@pytest.fixture(scope="module")
def meta() -> ModelMeta:
    try:
        return load_model_meta()
    except ModelLoadError as e:
        if torch.cuda.is_available():  # a GPU check's machine, where the model file may not travel
            pytest.skip(str(e))
        raise


@pytest.fixture(scope="module")
def grammars(meta) -> GrammarTokenizer:
    return GrammarTokenizer(meta.tokenizer, meta.config.vocab_size, [meta.tokenizer.eos_id])


def walk(grammars: GrammarTokenizer, texts: list[str], greedy: bool, seed: int) -> list[list[int]]:
    """Each grammar's tokens, chosen from random logits under its mask (argmax, or a softmax draw)
    until its matcher is done or it picks a stop token, BATCH rows at a time."""
    out: list[list[int]] = []
    for start in range(0, len(texts), BATCH):
        out += _walk_batch(grammars, texts[start : start + BATCH], greedy, torch.Generator().manual_seed(seed + start))
    return out


def _walk_batch(grammars: GrammarTokenizer, texts: list[str], greedy: bool, generator: torch.Generator) -> list[list[int]]:
    matchers = [grammars.matcher(text) for text in texts]
    tokens: list[list[int]] = [[] for _ in texts]
    live = list(range(len(texts)))
    for _ in range(MAX_TOKENS):
        logits = torch.randn(len(texts), grammars.vocab_size, generator=generator)
        logits = masked(logits, torch.tensor(live), fill_masks([matchers[i] for i in live], grammars.vocab_size))[live]
        chosen = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
        for i, token in zip(list(live), chosen.tolist()):
            matcher = matchers[i]
            if token in grammars.stop_ids:
                assert matcher.accepting, f"a stop token was allowed before {texts[i][:60]!r} was complete"
            else:
                tokens[i].append(token)
            matcher.consume(token)
            assert matcher.error is None
            if matcher.done:
                live.remove(i)
        if not live:
            return tokens
    raise AssertionError(f"{len(live)} walks ran past {MAX_TOKENS} tokens, e.g. {texts[live[0]][:200]}")


def test_schemas_are_valid_for_jsonschema_and_llguidance(grammars):
    assert len(SCHEMAS) == 55
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
        grammars.check(grammar_text("json_schema", schema))


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_json_schema_walks_give_valid_instances(meta, grammars, greedy):
    texts = [grammar_text("json_schema", schema) for schema in SCHEMAS]
    for schema, ids in zip(SCHEMAS, walk(grammars, texts, greedy, seed=1 + greedy)):
        text = meta.tokenizer.decode(ids, skip_special=False)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    "kind, value, valid",
    [
        ("regex", DATE, lambda text: re.fullmatch(DATE, text)),
        ("regex", EMAIL, lambda text: re.fullmatch(EMAIL, text)),
        ("choice", CHOICES, lambda text: text in CHOICES),
        ("lark", ARITHMETIC, lambda text: re.fullmatch(ARITHMETIC_TEXT, text)),
    ],
    ids=["date", "email", "choice", "lark"],
)
def test_other_kinds_walks_match(meta, grammars, kind, value, valid):
    texts = [grammar_text(kind, value)] * BATCH
    for greedy in (True, False):
        outputs = walk(grammars, texts, greedy, seed=3)
        assert all(valid(meta.tokenizer.decode(ids, skip_special=False)) for ids in outputs)
        assert len({tuple(ids) for ids in outputs}) > 1  # the rows' walks differ: each row had its own logits


def test_json_object_is_compact_unless_the_schema_says(grammars, meta):
    encode = meta.tokenizer.backend.encode
    matcher = grammars.matcher(grammar_text("json_object", None))
    for token in encode('{"a":[1,"x"]}', add_special_tokens=False).ids:
        matcher.consume(token)
    assert matcher.done and matcher.error is None  # the closing brace ends it: no stop token needed
    with pytest.raises(ValueError, match="do not follow the grammar"):
        grammars.matcher(grammar_text("json_object", None), encode('{ "a": 1}', add_special_tokens=False).ids)
    flexible = grammar_text("json_schema", {"x-guidance": {"whitespace_flexible": True}, "type": "object"})
    assert not grammars.matcher(flexible, encode('{ "a": 1', add_special_tokens=False).ids).done


def test_done_and_error_states(grammars, meta):
    encode = meta.tokenizer.backend.encode
    digits = grammars.matcher(grammar_text("regex", "[0-9]+"), encode("12", add_special_tokens=False).ids)
    assert digits.accepting and not digits.done  # more digits may follow: the model picks a stop token or goes on
    digits.consume(meta.tokenizer.eos_id)
    assert digits.done and digits.error is None
    wrong = grammars.matcher(grammar_text("regex", "[0-9]+"))
    wrong.consume(encode("x", add_special_tokens=False).ids[0])  # not allowed: recorded, never raised
    assert wrong.done and "doesn't satisfy the grammar" in wrong.error
    assert fill_masks([wrong], grammars.vocab_size).count_nonzero() == 1  # only the stop token's word is set


@pytest.mark.parametrize(
    "kind, value, message",
    [
        ("json_schema", {"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
        ("json_schema", {"type": "frobnicate"}, "frobnicate"),
        ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
        ("regex", "([0-9]+", "unclosed group"),
        ("json_schema", {"x-guidance": {"bogus": 1}, "type": "object"}, "unknown field `bogus`"),
        ("lark", "start: greeting\n", "unknown name"),
    ],
    ids=["min-above-max", "bad-type", "bad-ref", "bad-regex", "bad-x-guidance", "lark-undefined-rule"],
)
def test_invalid_grammars_are_refused_with_a_message(grammars, kind, value, message):
    text = grammar_text(kind, value)
    with pytest.raises(ValueError, match=message):
        grammars.check(text)
    with pytest.raises(ValueError, match=message):
        grammars.matcher(text)


@pytest.mark.parametrize(
    "kind, value, message",
    [
        ("choice", [], "non-empty list"),
        ("choice", ["yes", 1], "non-empty string"),
        ("choice", ["yes", ""], "non-empty string"),
        ("choice", "yes", "non-empty list"),
        ("json_schema", [{"type": "object"}], "JSON object"),
        ("json_schema", {"type": {"integer", "null"}}, "not JSON serializable"),
        ("json_object", {"type": "object"}, "no value"),
        ("regex", 5, "must be a string"),
        ("grammar", "start: x", "unknown grammar kind"),
    ],
)
def test_bad_values_are_refused(kind, value, message):
    with pytest.raises(ValueError, match=message):
        grammar_text(kind, value)


def test_long_errors_are_cut_short(grammars):
    with pytest.raises(ValueError) as error:
        grammars.check(grammar_text("regex", "(" + "a" * 2000))
    assert len(str(error.value)) <= 300


def test_every_kind_checks(grammars):
    values = {"json_schema": SCHEMAS[0], "json_object": None, "regex": DATE, "choice": CHOICES, "lark": ARITHMETIC}
    assert set(values) == set(GRAMMAR_KINDS)
    for kind, value in values.items():
        grammars.check(grammar_text(kind, value))


def test_structured_text_is_the_value_as_requests_carry_it():
    for kind, value, text in [
        ("json_schema", SCHEMAS[3], json.dumps(SCHEMAS[3])),
        ("json_object", None, ""),
        ("regex", DATE, DATE),
        ("choice", CHOICES, json.dumps(CHOICES)),
        ("lark", ARITHMETIC, ARITHMETIC),
    ]:
        assert structured_grammar(kind, text) == grammar_text(kind, value)
    bad = [("json_schema", "{", "must be JSON text"), ("choice", "[]", "non-empty list"), ("json_object", "{}", "no value")]
    for kind, text, message in bad:
        with pytest.raises(ValueError, match=message):
            structured_grammar(kind, text)


def test_grammars_built_aside(meta):
    built = grammars_built_aside(meta.tokenizer, meta.config.vocab_size, [meta.tokenizer.eos_id])
    assert built() is built() and built().stop_ids == (meta.tokenizer.eos_id,)
    with pytest.raises(ValueError, match="vocab size too small"):
        grammars_built_aside(meta.tokenizer, 100, [meta.tokenizer.eos_id])()


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    words = bitmask_row.tolist()
    return [t for t in range(vocab) if t // 32 < len(words) and (words[t // 32] >> (t % 32)) & 1]


def test_masked_touches_only_its_rows_and_copies(grammars):
    matchers = [grammars.matcher(grammar_text("choice", CHOICES)), grammars.matcher(grammar_text("regex", DATE))]
    bitmask = fill_masks(matchers, grammars.vocab_size)
    vocab = grammars.vocab_size + 40  # columns past the bitmask's width are never allowed
    logits = torch.randn(4, vocab)
    before = logits.clone()
    out = masked(logits, torch.tensor([2, 0]), bitmask)
    assert torch.equal(logits, before)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])
    for row, mask_row in ((2, bitmask[0]), (0, bitmask[1])):
        allowed = _allowed(mask_row, grammars.vocab_size)
        assert torch.isfinite(out[row]).nonzero().flatten().tolist() == allowed
        assert torch.equal(out[row, allowed], logits[row, allowed])
    half = masked(logits.bfloat16(), torch.tensor([0]), bitmask[1:])
    assert half.dtype == torch.bfloat16 and torch.isfinite(half[0]).nonzero().flatten().tolist() == _allowed(bitmask[1], vocab)
    empty = masked(logits, torch.tensor([], dtype=torch.long), bitmask[:0])
    assert torch.equal(empty, logits) and empty is not logits


def test_fill_masks_shape_and_vocab(grammars):
    assert fill_masks([], grammars.vocab_size).shape == (0, (grammars.vocab_size + 31) // 32)
    with pytest.raises(ValueError, match="tokens asked"):
        fill_masks([grammars.matcher(grammar_text("regex", DATE))], grammars.vocab_size + 32)


def test_readmitted_matcher_continues_where_it_left_off(grammars):
    text = grammar_text("json_schema", next(s for s in SCHEMAS if s["title"] == "order"))
    (ids,) = walk(grammars, [text], greedy=False, seed=11)
    original: GrammarMatcher = grammars.matcher(text)
    for k, token in enumerate(ids):
        again = grammars.matcher(text, ids[:k])
        assert torch.equal(fill_masks([again], grammars.vocab_size), fill_masks([original], grammars.vocab_size))
        original.consume(token)
    assert grammars.matcher(text, ids).done == original.done
    with pytest.raises(ValueError, match="do not follow the grammar"):
        grammars.matcher(text, ids[:1] + ids[:1])
