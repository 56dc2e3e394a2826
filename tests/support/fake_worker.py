"""A tensor-free stand-in for the worker that keeps real page contents.

It stores every token written at its slot, and its "model" predicts the next
token from what the request's page table actually shows. So if the scheduler
gets any page, position or retraction wrong, the tokens come out different
from `reference_next` applied to the true sequence.

`fails(seq)` makes an entry fail, as a request's bad parameters fail a real
step: it sees the entry's sequence up to the end of its step and returns an
error message or None. A failed entry's KV is written as garbage (POISON), so
any reuse of it shows up in later tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import msgspec
import numpy as np

from radixrt.messages import (
    BatchEntry,
    BatchResult,
    EntryError,
    EntryLogprobs,
    ForwardBatch,
    KVMove,
    MoveKind,
    SpecVerdict,
    WorkerReady,
    disk_page_name,
)

VOCAB = 50
POISON = 17  # what a failed step writes into its KV slots


def reference_next(seq: list[int], length: int | None = None) -> int:
    """The next token after seq: it reads the last 8 tokens and the sequence's length (which a
    request under a retention policy gives apart: seq is then only what its pages keep)."""
    return (sum((i + 1) * t for i, t in enumerate(seq[-8:])) + (len(seq) if length is None else length)) % VOCAB


def reference_generate(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(reference_next(seq))
    return seq[len(prompt):]


def fake_readout(e: BatchEntry, seq: list[int]) -> bytes:
    """A made-up readout with the real one's shape of work: "mean" the sum of the chunk's token ids
    (the scheduler divides), "last" / "head" the last token id, "cls" the first, "labels" each label
    id plus the last token id; float32 bytes."""
    kind = e.readout.kind
    values = {"mean": [sum(e.input_ids)], "cls": [seq[0]], "labels": [t + seq[-1] for t in e.readout.label_ids]}
    return np.array(values.get(kind, [seq[-1]]), dtype=np.float32).tobytes()


class FakeWorker:
    def __init__(self, num_pages: int, page_size: int, context_length: int = 4096, eos_ids=(49,),
                 host_pages: int = 0, disk_dir: str = "", disk_pages: int = 0,
                 fails: Callable[[list[int]], str | None] | None = None,
                 draft_wrong: Callable[[list[int]], bool] = lambda seq: False,
                 step_seconds: Callable[[int], float] = lambda tokens: 0.0) -> None:
        self.ready = WorkerReady(num_pages, page_size, VOCAB, context_length, list(eos_ids), 8, page_size * 8,
                                 host_pages, disk_dir, disk_pages)
        self.page_size = page_size
        self.slots: dict[int, int] = {}  # slot -> token at that KV slot
        self.tables: dict[int, list[int]] = {}  # request slot -> page table
        self.host: dict[int, list] = {}  # host page -> the tokens its KV is of
        self.disk: dict[str, list] = {}  # file key -> the same
        self.fails = fails
        self.draft_wrong = draft_wrong  # STANDALONE's fake draft model errs after these sequences
        self.step_seconds = step_seconds  # the forward_seconds it reports for a step of that many tokens
        self.verified: list[tuple[int, int]] = []  # (drafts, accepted) per verified entry
        self.views: list[tuple[int, list[int]]] = []  # (sequence length, what its pages show) per retention entry

    def _file(self, key: str) -> Path:
        return Path(self.ready.disk_dir) / disk_page_name(key)

    def _page(self, page: int) -> list:
        return [self.slots.get(page * self.page_size + i) for i in range(self.page_size)]

    def _fill(self, page: int, tokens: list) -> None:
        for i, tok in enumerate(tokens):
            self.slots[page * self.page_size + i] = tok

    def move(self, moves: list[KVMove]) -> None:
        """The tier moves, in order, on page contents (what the real worker does with bytes)."""
        for m in moves:
            if m.kind is MoveKind.D2H:
                for src, dst in zip(m.src, m.dst):
                    self.host[dst] = self._page(src)
            elif m.kind is MoveKind.H2D:
                for src, dst in zip(m.src, m.dst):
                    self._fill(dst, self.host[src])
            elif m.kind in (MoveKind.H2DISK, MoveKind.D2DISK):
                for src, key in zip(m.src, m.keys):
                    self.disk[key] = self.host[src] if m.kind is MoveKind.H2DISK else self._page(src)
                    self._file(key).write_bytes(b"")  # the scheduler checks a page's file is there
            elif m.kind is MoveKind.DISK2D:
                for key, dst in zip(m.keys, m.dst):
                    self._fill(dst, self.disk[key])
            else:
                assert m.kind is MoveKind.DROP, m.kind
                for key in m.keys:
                    del self.disk[key]
                    self._file(key).unlink()

    def _propose(self, seq: list[int], k: int) -> list[int]:
        """STANDALONE's draft model: the reference, wrong where draft_wrong says so."""
        out: list[int] = []
        for _ in range(k):
            t = reference_next(seq + out)
            out.append((t + 1) % VOCAB if self.draft_wrong(seq + out) else t)
        return out

    def _verify(self, e: BatchEntry, seq: list[int]) -> tuple[SpecVerdict, int]:
        """The drafts at the end of seq against the reference at each of their positions."""
        base = len(seq) - e.draft_len
        target = [reference_next(seq[: base + j]) for j in range(e.draft_len + 1)]
        draft = seq[base:]
        n = next((j for j in range(e.draft_len) if draft[j] != target[j]), e.draft_len)
        self.verified.append((e.draft_len, n))
        return SpecVerdict(draft, n), target[n]

    def forward(self, batch: ForwardBatch) -> BatchResult:
        for s in batch.freed_slots:
            self.tables.pop(s, None)
        for src, dst in zip(batch.copy_src, batch.copy_dst):
            self.slots[dst] = self.slots[src]
        next_ids, logprobs, errors, masses, spec = [], [], [], [], []
        readouts = [b""] * len(batch.entries)
        tokens = sum(len(e.input_ids) + e.propose for e in batch.entries)
        for i, e in enumerate(batch.entries):
            if e.init is not None:
                assert e.slot not in self.tables, f"slot {e.slot} reused before the scheduler freed it"
                self.tables[e.slot] = []
            if e.retain is not None:  # middle pages dropped: the page table anew
                self.tables[e.slot] = list(e.retain.pages)
            table = self.tables[e.slot]
            table += e.new_pages
            if e.propose:  # STANDALONE: drafts appended, then verified like the scheduler's own
                prefix = [self.slots[table[p // self.page_size] * self.page_size + p % self.page_size]
                          for p in range(e.start_pos)] + e.input_ids
                e = msgspec.structs.replace(e, input_ids=e.input_ids + self._propose(prefix, e.propose), draft_len=e.propose)
            slot_of = lambda pos: table[pos // self.page_size] * self.page_size + pos % self.page_size  # noqa: E731
            end = e.start_pos + len(e.input_ids)
            seq = [self.slots[slot_of(p)] for p in range(e.start_pos)] + e.input_ids
            error = self.fails(seq) if self.fails is not None else None
            for pos, tok in zip(range(e.start_pos, end), e.input_ids):
                self.slots[slot_of(pos)] = POISON if error is not None else tok
            if error is not None:
                errors.append(EntryError(i, error))
                logprobs.append(None)
                continue
            length = e.start_pos + e.pos_offset + len(e.input_ids)  # where the step ends in the sequence
            if e.pos_offset or e.retain is not None or e.want_mass:
                self.views.append((length, seq))
            if e.want_mass:  # a made-up attention mass per page: its tokens' values
                masses.append(i)
            if e.sample and e.draft_len:
                verdict, next_id = self._verify(e, seq)
                spec.append(verdict)
                next_ids.append(next_id)
            elif e.sample:
                next_ids.append(reference_next(seq, length))
            logprobs.append(EntryLogprobs(output=-1.0) if e.logprobs is not None else None)
            if e.readout is not None:
                readouts[i] = fake_readout(e, seq)
        page_mass = [[] for _ in batch.entries] if masses else []
        for i in masses:
            page_mass[i] = [float(sum(t or 0 for t in self._page(p))) for p in self.tables[batch.entries[i].slot]]
        return BatchResult(batch.step, next_ids, logprobs if any(logprobs) else [], errors=errors, page_mass=page_mass,
                           spec=spec, forward_seconds=self.step_seconds(tokens),
                           readouts=readouts if any(e.readout for e in batch.entries) else [])
