"""Prefix-sharing workloads built from the shipped corpus (used by tests and benchmarks)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]


def shared_document(corpus: list[int], n_questions: int, doc_len: int = 1500, seed: int = 0) -> Workload:
    """One long document, then a distinct short question per request (RAG over one document)."""
    rng = random.Random(seed)
    doc = corpus[:doc_len]
    questions = []
    for _ in range(n_questions):
        start = rng.randrange(doc_len, len(corpus) - 40)
        questions.append(doc + corpus[start : start + rng.randint(5, 30)])
    return Workload("shared_document", questions)


def forks(corpus: list[int], n_trunks: int, trunk_len: int, branches: int, seed: int = 0) -> Workload:
    """Several trunks, each continued by a few different branches (a forked program)."""
    rng = random.Random(seed)
    prompts = []
    for t in range(n_trunks):
        trunk = corpus[t * trunk_len : (t + 1) * trunk_len]
        for _ in range(branches):
            start = rng.randrange(0, len(corpus) - 40)
            prompts.append(trunk + corpus[start : start + rng.randint(8, 24)])
    return Workload("forks", prompts)


def interleave(groups: list[list[list[int]]]) -> list[list[int]]:
    """Round-robin across groups: arrivals alternate between documents."""
    out = []
    for i in range(max(len(g) for g in groups)):
        out += [g[i] for g in groups if i < len(g)]
    return out


def chat_turn_user_tokens(corpus: list[int], conversations: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """[conversation][turn] -> the user's tokens for that turn (the assistant's come from the model)."""
    rng = random.Random(seed)
    out = []
    for _ in range(conversations):
        conv = []
        for _ in range(turns):
            start = rng.randrange(0, len(corpus) - 80)
            conv.append(corpus[start : start + rng.randint(20, 60)])
        out.append(conv)
    return out


def cycling_documents(corpus: list[int], n_docs: int, doc_len: int, questions: int, seed: int = 0) -> list[list[list[int]]]:
    """[document][question] -> prompt: distinct documents, each asked a few short questions;
    run document by document, pass after pass, more documents than a small pool holds."""
    rng = random.Random(seed)
    step = (len(corpus) - 64) // n_docs
    groups = []
    for d in range(n_docs):
        doc = corpus[d * step : d * step + doc_len]
        starts = [rng.randrange(0, len(corpus) - 32) for _ in range(questions)]
        groups.append([doc + corpus[s : s + rng.randint(6, 16)] for s in starts])
    return groups
