"""Incremental detokenization: the text equals a full decode, nothing emitted is ever taken back
(no half characters), and no part of a stop string is ever emitted."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.client.detokenizer import IncrementalDetokenizer
from engine.demo_model import build_tokenizer

TEXTS = [
    "Hello, world! The weather is nice today.",
    "中文：你好，世界。我们今天学习机器学习。",
    "emoji 😀🎉🚀 and ZWJ 👨‍👩‍👧, a flag 🇫🇷 and ❤️ — done.",
    "日本語：こんにちは、世界。한국어: 안녕하세요. Ελληνικά 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def stream(
    det: IncrementalDetokenizer,
    ids: list[int],
    rng: random.Random,
    expected: str,
    max_chunk: int = 3,
) -> list[str]:
    """Feed `ids` in random chunks; every prefix of what was emitted must be a prefix of
    `expected` (nothing taken back, no half character, no piece of a stop string)."""
    deltas: list[str] = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        deltas.append(det.step(ids[i : i + n]))
        i += n
        assert "".join(deltas) == det.text and expected.startswith(det.text), (det.text, expected)
    deltas.append(det.flush())
    assert "".join(deltas) == det.text
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_match_full_decode(
    tok: PreTrainedTokenizerFast, skip_special_tokens: bool
) -> None:
    rng = random.Random(0)
    for trial in range(300):
        prompt = tok.encode(rng.choice(TEXTS))[: rng.randint(0, 12)]
        # Mostly multi-byte pieces (ids past 128 are byte symbols of UTF-8 lead/continuation
        # bytes or merges of them), some specials, some ASCII.
        output = [
            rng.choice([rng.randint(0, 2), rng.randint(3, 130), rng.randint(131, 511)])
            for _ in range(rng.randint(0, 40))
        ]
        want = tok.decode(output, skip_special_tokens=skip_special_tokens)
        det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
        stream(det, output, rng, want, max_chunk=1 + trial % 4)
        assert det.text == want and not det.finished_by_stop


def test_valid_text_streams_without_replacement_chars(tok: PreTrainedTokenizerFast) -> None:
    rng = random.Random(1)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    for text in TEXTS:
        det = IncrementalDetokenizer(tok, tok.encode(prompt))
        deltas = stream(det, tok.encode(text) + [2], rng, text, max_chunk=1)
        assert det.text == text
        assert not any("\ufffd" in d for d in deltas)


def test_text_before_an_unfinished_character_is_emitted(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("ab😀")
    # The emoji spans several tokens: "ab" plus its first piece decode to "ab" + U+FFFD.
    cut = next(k for k in range(len(ids)) if tok.decode(ids[:k]).startswith("ab\ufffd"))
    assert cut < len(ids)
    det = IncrementalDetokenizer(tok, [])
    assert det.step(ids[:cut]) == "ab"
    assert [det.step([i]) for i in ids[cut:]] == [""] * (len(ids) - cut - 1) + ["😀"]


def test_flush_emits_an_unfinished_character(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("中")[:-1]  # "中" is 3 bytes over more than one token
    assert ids and tok.decode(ids).endswith("\ufffd")
    det = IncrementalDetokenizer(tok, [])
    assert det.step(ids) == ""
    assert det.flush() == tok.decode(ids) == det.text


@pytest.mark.parametrize("text", TEXTS)
def test_stop_string_truncates_and_is_never_emitted(
    tok: PreTrainedTokenizerFast, text: str
) -> None:
    rng = random.Random(hash(text) % 1000)
    for _ in range(40):
        start = rng.randrange(len(text))
        stop = text[start : start + rng.randint(1, 6)]
        want = text[: text.find(stop)]
        det = IncrementalDetokenizer(tok, tok.encode("Q: "), stop=(stop, "never appears"))
        stream(det, tok.encode(text), rng, want)
        assert det.text == want and det.stop_matched == stop and det.finished_by_stop
        assert det.step(tok.encode("more text")) == "" and det.flush() == ""


def test_partial_stop_is_held_then_flushed(tok: PreTrainedTokenizerFast) -> None:
    det = IncrementalDetokenizer(tok, [], stop=("abc",))
    assert det.step(tok.encode("The answer is a")) == "The answer is "
    assert det.step(tok.encode("b")) == ""
    assert det.step(tok.encode("d ab")) == "abd "
    assert det.text == "The answer is abd "
    assert det.flush() == "ab" and det.text == "The answer is abd ab" and not det.finished_by_stop


def test_first_completed_stop_wins(tok: PreTrainedTokenizerFast) -> None:
    for stop in [("END", "x E"), ("x E", "END")]:
        det = IncrementalDetokenizer(tok, [], stop=stop)
        det.step(tok.encode("one two x END three"))  # both in one step: the earlier one wins
        assert det.text == "one two " and det.stop_matched == "x E"
    det = IncrementalDetokenizer(tok, [], stop=("bc", "abcd"))
    for piece in "abcd":
        det.step(tok.encode(piece))
    assert det.text == "a" and det.stop_matched == "bc"


def test_stop_on_special_token_text(tok: PreTrainedTokenizerFast) -> None:
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=False, stop=("<|im_end|>",))
    assert det.step(tok.encode("hi ")) == "hi "
    assert det.step([2]) == "" and det.stop_matched == "<|im_end|>" and det.text == "hi "


def test_no_stop_trim_keeps_the_stop_string(tok: PreTrainedTokenizerFast) -> None:
    det = IncrementalDetokenizer(tok, [], stop=("x E",), no_stop_trim=True)
    det.step(tok.encode("one two x"))
    det.step(tok.encode(" END three"))
    assert det.stop_matched == "x E" and det.text.startswith("one two x E") and det.step([5]) == ""
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=False, stop=("<|im_end|>",), no_stop_trim=True,
                                 spaces_between_special_tokens=False)
    det.step(tok.encode("hi "))
    assert det.step([2]) == "<|im_end|>" and det.text == "hi <|im_end|>"


def test_prefix_offset_keeps_the_space_a_leading_token_implies() -> None:
    # A SentencePiece-style tokenizer drops the "▁" of the first token of a decode; the prompt
    # context in front of the output keeps it.
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    words = "hello there general kenobi you are a bold one".split()
    sp.train_from_iterator(
        [" ".join(words)] * 3,
        trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=sp, clean_up_tokenization_spaces=False)
    prompt, output = tok.encode("hello there"), tok.encode("general kenobi you are")
    assert tok.decode(output) == "general kenobi you are"  # the leading space is gone alone
    det = IncrementalDetokenizer(tok, prompt)
    stream(det, output, random.Random(2), " general kenobi you are")
    assert (
        det.text
        == tok.decode(prompt + output)[len(tok.decode(prompt)) :]
        == " general kenobi you are"
    )


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_whole_response_decoded_once_equals_the_streamed_text(tok: PreTrainedTokenizerFast, skip_special_tokens: bool) -> None:
    """A whole response decoded once at the end (RequestState with incremental False, as the
    server does for non-streamed requests without stop strings) has the text of the token-by-token
    path, for random ids (half characters, specials) and for real text, with any prompt."""
    from engine.client.output import RequestState
    from engine.core.protocol import RequestDelta
    from engine.request import SamplingParams

    rng = random.Random(5)
    cases = [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(150)]
    cases += [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for ids in cases:
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 8))]
        states = [RequestState("r", prompt, params, tok, incremental=inc) for inc in (True, False)]
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            delta = RequestDelta(request_id="r", new_token_ids=[t], finished=last, finish_reason="length" if last else None)
            updates = [s.apply(delta) for s in states]
        assert updates[0].finished and updates[1].finished
        assert states[1].output.text == states[0].output.text, (prompt, ids)
        assert states[1].output.output_ids == states[0].output.output_ids == ids
    with pytest.raises(ValueError, match="stop strings"):
        RequestState("r", [1], SamplingParams(stop=("x",)), tok, incremental=False)


class _Wrapped:
    """A tokenizer that only forwards `decode`: the detokenizer must take its slow, general path."""

    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self.decode = tok.decode


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_direct_decoding_emits_what_transformers_decoding_emits(
    tok: PreTrainedTokenizerFast, skip_special_tokens: bool
) -> None:
    """The fast path (the Rust decode called directly, single-token lengths cached) gives the same
    deltas, step by step, as decoding through transformers every time."""
    from engine.client.detokenizer import direct_decoder

    assert direct_decoder(tok, skip_special_tokens) is not None and direct_decoder(_Wrapped(tok), True) is None
    rng = random.Random(7)
    for _ in range(200):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        output = [rng.choice([rng.randint(0, 2), rng.randint(3, 130), rng.randint(131, 511)]) for _ in range(rng.randint(1, 40))]
        fast, slow = (IncrementalDetokenizer(t, prompt, skip_special_tokens=skip_special_tokens) for t in (tok, _Wrapped(tok)))
        i = 0
        while i < len(output):
            n = rng.randint(1, 3)
            assert fast.step(output[i : i + n]) == slow.step(output[i : i + n])
            i += n
        assert fast.flush() == slow.flush() and fast.text == slow.text


def test_no_direct_decoding_where_transformers_would_change_the_text(tok: PreTrainedTokenizerFast) -> None:
    from engine.client.detokenizer import direct_decoder

    cleaned = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, clean_up_tokenization_spaces=True)
    assert direct_decoder(cleaned, True) is None

    class Custom(PreTrainedTokenizerFast):
        def decode(self, *args: object, **kwargs: object) -> str:
            return super().decode(*args, **kwargs).upper()

    custom = Custom(tokenizer_object=tok.backend_tokenizer, clean_up_tokenization_spaces=False)
    assert direct_decoder(custom, True) is None
    assert IncrementalDetokenizer(custom, []).step(tok.encode("hello")) == "HELLO"
