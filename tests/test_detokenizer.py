"""The batched incremental detokenizer (`asyncllm._core.Detokenizer`) against the
Python `tokenizers` package, for every tokenizer in shared/assets.

The reference (see rust/detok/mod.rs): with `D` = `tokenizer.decode` (or, without
`spaces_between_special_tokens`, each run of non-added tokens decoded apart with
added tokens' contents glued in), a request with prompt P and output O releases
`D(P + O)` past its longest common prefix with `D(P)`; with stop strings, that
text cut at the earliest-ending match.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field

import pytest
from tokenizers import Tokenizer

from asyncllm._core import Detokenizer, DetokenizerError
from conftest import tokenizer_dir

FAMILIES = [
    "gpt2",
    "llama-2",
    "mistral-v0.1",
    "llama-3-8b",
    "qwen2.5",
    "bert-base-uncased",
    "phi-2",
    "gpt-neox-20b",
    "t5-small",
]

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock, isn't it?",
    "日本語の文章です。中文也可以：你好，世界！한국어 텍스트도 있습니다.",
    "Emoji: 👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👩🏽‍💻 coder, 🇯🇵🇺🇸, ❤️‍🔥 and 🫠.",
    "مرحبا بالعالم! هذه جملة عربية مع أرقام ١٢٣ وعلامات ترقيم؟",
    "def main():\n\tfor i in range(10):\n\t\tprint(i,    end='  ')\n\n    return  {'a': [1, 2]}\n",
    "Ελληνικά, русский текст, עברית, हिन्दी, ไทย — mixed “quotes” … and ‘more’.",
    "  leading spaces,\ttabs\t\tand trailing   \n\n\nnew lines   ",
]


@dataclass
class Ref:
    """The Python-side reference decode for one tokenizer."""

    tok: Tokenizer
    added: dict[int, str] = field(init=False)
    special: set[str] = field(init=False)

    def __post_init__(self) -> None:
        decoder = self.tok.get_added_tokens_decoder()
        self.added = {i: t.content for i, t in decoder.items()}
        self.special = {t.content for t in decoder.values() if t.special}

    def decode(self, ids: list[int], skip: bool, spaces: bool) -> str:
        if spaces:
            return self.tok.decode(ids, skip_special_tokens=skip)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            token = self.tok.id_to_token(i)
            if token is None or (skip and token in self.special):
                continue
            if i in self.added:
                parts += [self.tok.decode(run, skip_special_tokens=skip), token]
                run = []
            else:
                run.append(i)
        parts.append(self.tok.decode(run, skip_special_tokens=skip))
        return "".join(parts)

    def continuation(self, prompt: list[int], out: list[int], skip: bool, spaces: bool) -> str:
        full = self.decode(prompt + out, skip, spaces)
        before = self.decode(prompt, skip, spaces)
        return full[len(os.path.commonprefix([full, before])) :]


_CACHE: dict[str, tuple[Ref, Detokenizer]] = {}


def load(name: str) -> tuple[Ref, Detokenizer]:
    if name not in _CACHE:
        path = tokenizer_dir(name) / "tokenizer.json"
        _CACHE[name] = (Ref(Tokenizer.from_file(str(path))), Detokenizer(str(path)))
    return _CACHE[name]


def encode(ref: Ref, text: str) -> list[int]:
    return ref.tok.encode(text, add_special_tokens=False).ids


@dataclass
class Case:
    prompt: list[int]
    out: list[int]
    skip: bool = True
    spaces: bool = True
    stop: list[str] = field(default_factory=list)
    include: bool = False
    min_tokens: int = 0
    # Filled by run_batched: one entry per step that carried this case.
    texts: list[str] = field(default_factory=list)
    items: list[tuple[str, int | None, int, int]] = field(default_factory=list)


def run_batched(det: Detokenizer, cases: list[Case], rng: random.Random) -> None:
    """Streams all cases concurrently through `det`, in random chunk sizes, with
    random subsets of requests per step, finishing each with its last chunk."""
    base = rng.randrange(1 << 40)
    for i, c in enumerate(cases):
        det.add_request(
            base + i,
            c.prompt,
            skip_special_tokens=c.skip,
            spaces_between_special_tokens=c.spaces,
            stop=c.stop,
            include_stop_str_in_output=c.include,
            min_tokens=c.min_tokens,
        )
    pos = [0] * len(cases)
    live = set(range(len(cases)))
    while live:
        chosen = [i for i in sorted(live) if rng.random() < 0.7] or [min(live)]
        rng.shuffle(chosen)
        ids, chunks, finished = [], [], []
        for i in chosen:
            size = rng.choice([0, 1, 1, 1, 2, 3, 5, 8])
            chunk = cases[i].out[pos[i] : pos[i] + size]
            pos[i] += len(chunk)
            ids.append(base + i)
            chunks.append(chunk)
            finished.append(pos[i] == len(cases[i].out))
        finished_ids = [rid for rid, done in zip(ids, finished, strict=True) if done]
        results = det.step(ids, chunks, finished_ids)
        assert len(results) == len(chosen)
        for i, done, res in zip(chosen, finished, results, strict=True):
            c = cases[i]
            c.texts.append(res[0])
            c.items.append(res)
            if res[1] is not None and not done:
                det.remove(base + i)
                done = True
            if done:
                live.discard(i)
    assert all(base + i not in det for i in range(len(cases)))


def random_ids(ref: Ref, rng: random.Random, n: int) -> list[int]:
    vocab = ref.tok.get_vocab_size(with_added_tokens=True)
    # A few ids past the vocabulary (models pad their embeddings): decode drops them.
    return [rng.randrange(vocab + 8) for _ in range(n)]


@pytest.mark.parametrize("name", FAMILIES)
def test_released_text_equals_reference_decode(name: str) -> None:
    ref, det = load(name)
    rng = random.Random(f"detok-{name}")
    sequences = [encode(ref, t) for t in TEXTS]
    sequences += [random_ids(ref, rng, rng.randrange(1, 60)) for _ in range(40)]
    # Real text cut at every kind of place, and random prompts before real text.
    sequences += [random_ids(ref, rng, 5) + encode(ref, t) for t in TEXTS]
    cases = []
    for seq in sequences:
        for skip, spaces in [(True, True), (False, True), (True, False), (False, False)]:
            cut = rng.choice([0, rng.randrange(len(seq) + 1)])
            cases.append(Case(seq[:cut], seq[cut:], skip, spaces))
    run_batched(det, cases, rng)
    for c in cases:
        want = ref.continuation(c.prompt, c.out, c.skip, c.spaces)
        got = "".join(c.texts)
        assert got == want, (name, c.prompt, c.out, c.skip, c.spaces)
        assert sum(item[2] for item in c.items) == len(c.out)
        assert c.items[-1][3] == len(c.out)


@pytest.mark.parametrize("name", ["gpt2", "llama-2", "bert-base-uncased", "qwen2.5"])
def test_tokens_released_never_run_ahead_of_text(name: str) -> None:
    ref, det = load(name)
    rng = random.Random(f"released-{name}")
    cases = [Case([], encode(ref, t)) for t in TEXTS]
    run_batched(det, cases, rng)
    for c in cases:
        released = ""
        for text, (_, _, _, num_released) in zip(c.texts, c.items, strict=True):
            released += text
            # The text of the first `num_released` tokens is all out already.
            done = ref.continuation([], c.out[:num_released], True, True)
            assert released.startswith(done.rstrip("\ufffd"))


def truncate(text: str, stops: list[str], include: bool, min_end: int) -> tuple[str, int | None]:
    """`text` cut at the earliest-ending stop match ending after `min_end`
    (ties: the longest); the stop's index or None."""
    best = None
    for index, stop in enumerate(stops):
        start = text.find(stop, max(0, min_end + 1 - len(stop)))
        if start >= 0:
            key = (start + len(stop), start)
            if best is None or key < best[0]:
                best = (key, index)
    if best is None:
        return text, None
    (end, start), index = best
    return text[: end if include else start], index


def stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop."""
    return max(
        (n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])),
        default=0,
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_stop_strings(name: str) -> None:
    ref, det = load(name)
    rng = random.Random(f"stop-{name}")
    cases = []
    for text in TEXTS + TEXTS:
        out = encode(ref, text)
        full = ref.continuation([], out, True, True)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            a = rng.randrange(len(full))
            stops.append(full[a : a + rng.randrange(1, 6)])
        stops.append("never appears \x00")
        rng.shuffle(stops)
        min_tokens = rng.choice([0, 0, 1, len(out) // 2])
        cases.append(Case([], out, stop=stops, include=rng.random() < 0.5, min_tokens=min_tokens))
    # Text decided after each token, from a plain token-by-token stream.
    plain = [Case([], c.out) for c in cases]
    for p in plain:
        p_items = []
        det.add_request(0, [])
        for tok_id in p.out:
            p_items.append(det.step([0], [[tok_id]])[0][0])
        p_items.append(det.finish(0)[0])
        p.texts = p_items
    run_batched(det, cases, rng)
    for c, p in zip(cases, plain, strict=True):
        decided = "".join(p.texts)
        before_min = "".join(p.texts[: max(c.min_tokens - 1, 0)])
        min_end = len(before_min) if c.min_tokens > 1 else 0
        want, index = truncate(decided, c.stop, c.include, min_end)
        got = "".join(c.texts)
        assert got == want, (name, c.stop, c.include, c.min_tokens, decided)
        assert c.items[-1][1] == index
        # Never anything beyond the cut, and only stop-prefix suffixes held back.
        released, fed = "", 0
        for text, item in zip(c.texts, c.items, strict=True):
            released += text
            fed += item[2]
            assert want.startswith(released)
            if item[1] is None and fed < len(c.out):
                so_far = "".join(p.texts[:fed])
                assert released == so_far[: len(so_far) - stop_prefix_suffix(so_far, c.stop)]
        if index is not None:
            # The last kept token is the one whose text completed the match.
            match_end = len(want) if c.include else len(want) + len(c.stop[index])
            kept = fed
            assert len("".join(p.texts[: kept - 1])) < match_end <= len("".join(p.texts[:kept]))


def test_prompt_seeding_sentencepiece_space_and_partial_utf8() -> None:
    ref, det = load("llama-2")
    prompt = ref.tok.encode("Hello").ids  # with <s>
    world = ref.tok.token_to_id("▁world")
    det.add_request(1, prompt)
    assert det.finish(1)[0] == "", "prompt text is never re-emitted"
    det.add_request(1, prompt)
    assert det.step([1], [[world]], [1])[0][0] == " world"
    det.add_request(2, [])
    assert det.step([2], [[world]], [2])[0][0] == "world"
    # A prompt ending inside a character: the output completes and emits it once.
    ids = encode(ref, "x 🫠")
    byte_start = next(i for i, t in enumerate(ids) if ref.tok.id_to_token(t).startswith("<0x"))
    det.add_request(3, ids[: byte_start + 1])
    texts = [r[0] for r in [det.step([3], [[t]])[0] for t in ids[byte_start + 1 :]]]
    texts.append(det.finish(3)[0])
    assert "".join(texts) == "🫠"


def test_errors() -> None:
    ref, det = load("gpt2")
    assert issubclass(DetokenizerError, ValueError)
    with pytest.raises(DetokenizerError, match="cannot load"):
        Detokenizer("/nonexistent/tokenizer.json")
    with pytest.raises(DetokenizerError, match="cannot load"):
        Detokenizer.from_json("{not json")
    det.add_request(11, [])
    with pytest.raises(DetokenizerError, match="already"):
        det.add_request(11, [])
    with pytest.raises(DetokenizerError, match="empty"):
        det.add_request(12, [], stop=[""])
    with pytest.raises(DetokenizerError, match="not in the detokenizer"):
        det.step([11, 13], [[1], [2]])
    with pytest.raises(DetokenizerError, match="more than once"):
        det.step([11, 11], [[1], [2]])
    with pytest.raises(DetokenizerError, match="differ in length"):
        det.step([11], [[1], [2]])
    with pytest.raises(DetokenizerError, match="finished request 12 is not in the batch"):
        det.step([11], [[1]], [12])
    # Failed steps changed nothing.
    assert det.step([11], [encode(ref, "Hi")])[0] == ("Hi", None, 1, 1)
    assert det.remove(11) and not det.remove(11)
    with pytest.raises(DetokenizerError):
        det.finish(11)


def test_from_json_matches_from_file() -> None:
    path = tokenizer_dir("t5-small") / "tokenizer.json"
    det = Detokenizer.from_json(path.read_text())
    ref, _ = load("t5-small")
    ids = encode(ref, "Hello there, world.")
    det.add_request(1, [])
    assert det.step([1], [ids], [1])[0][0] == ref.tok.decode(ids)


def test_step_releases_the_gil() -> None:
    """While one thread is inside a long `step`, another runs Python: it records
    times in the middle of the step, which it could not if the step held the GIL.
    (Causality, not a rate: on a loaded machine the other thread may run slowly,
    but it runs.)"""
    ref, det = load("gpt2")
    rng = random.Random("gil")
    n_req, n_tok = 512, 2000
    ids = list(range(n_req))
    for i in ids:
        det.add_request(i, [], stop=["never ever"])
    chunks = [random_ids(ref, rng, n_tok) for _ in ids]
    entered = threading.Event()
    done = threading.Event()
    step_span: list[float] = []

    def big_step() -> None:
        entered.set()
        t0 = time.perf_counter()
        for _ in range(3):
            det.step(ids, chunks)
        step_span.extend((t0, time.perf_counter()))
        done.set()

    worker = threading.Thread(target=big_step)
    worker.start()
    entered.wait()
    ticks = []
    while not done.is_set():
        ticks.append(time.perf_counter())
    worker.join()
    for i in ids:
        det.remove(i)
    start, end = step_span
    quarter = (end - start) / 4
    middle = [t for t in ticks if start + quarter <= t <= end - quarter]
    assert middle, (
        f"no Python ran during the middle half of a {end - start:.3f}s step: it held the GIL"
    )


def test_step_inputs_and_output_views() -> None:
    import array

    ref, det = load("gpt2")
    hello, world, bang = encode(ref, "Hello world!")
    det.add_request(1, [])
    det.add_request(2, [], stop=[" world"], include_stop_str_in_output=True)
    # Ints, sequences and buffers of ids give the same results.
    out = det.step([1, 2], [hello, [hello]])
    assert out.texts == ["Hello", "Hello"]
    out = det.step([1, 2], array.array("I", [world, world]))
    assert len(out) == 2
    assert out.texts == [" world", " world"]
    assert out.stops == [(1, 0, 1)]
    assert out.num_kept == [1, 1]
    assert out.num_tokens_released == [2, 2]
    assert out[1] == (" world", 0, 1, 2)
    assert out[-1] == out[1]
    with pytest.raises(IndexError):
        out[2]
    # A stopped request keeps nothing; finishing drops it.
    out = det.step([1, 2], array.array("q", [bang, bang]), [1, 2])
    assert (out.texts, out.num_kept, out.stops) == (["!", ""], [1, 0], [])
    assert len(det) == 0
    det.add_request(3, [])
    with pytest.raises(OverflowError):
        det.step([3], array.array("q", [-1]))
