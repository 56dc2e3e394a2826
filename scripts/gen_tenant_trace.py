"""Generate a multi-tenant request trace whose distinct shared prefixes outgrow a device KV pool.

The workload issue 33's bench/kv_tiers.py runs: eviction policies (LRU, LFU, cost-aware) and the
host/disk tiers differ on it because popularity, recency and prefix length vary independently.

Each tenant has a system prompt and a catalog of documents; every request starts with its tenant's
system prompt, then one of three kinds:
  * doc     a catalog document and a short question. Documents are picked Zipf-like (weight
            1/rank**zipf_s) and their lengths are drawn independently of their rank, so a long
            document may be rare and a short one popular (what a cost-aware policy weighs);
  * upload  a one-off document asked 1-3 questions in a short burst, never seen again (a scan:
            recency helps within the burst, frequency should not keep it afterwards);
  * chat    a user's multi-turn conversation: turn k resends the whole history (user turns and
            canned assistant replies) and adds a new user message.
Tenants are picked Zipf-like too (weight 1/rank**tenant_zipf_s); arrivals of all tenants are
drawn over one span and merged, so the file's order (its arrival order) interleaves tenants.
Prompts are token ids (exact: no tokenizer between the trace and the KV cache) drawn uniformly
from [3, vocab), below the tiny models' 1024-token vocabulary and past its special tokens.

System prompts and documents are a whole number of `align` (16) tokens long and a doc/upload
question is shorter than that, so with page size 16 a doc request's full pages are exactly its
shared prefix. Requests for the documents of popularity ranks `pin_ranks` (1 and 4: not the
most popular, which its popularity alone keeps cached) of the first `pinned_tenants` tenants carry
`cache_control: {"type": "ephemeral", "ttl": "5m"}` and `pinned: true`; whole-prompt pins
then pin the shared prefix only.

One JSON object a line, in arrival order:
  id, arrival (seconds at `rate` requests/s), tenant, kind (doc|upload|chat), prefix (the name of
  the shared prefix: "t1/d3", "t1/u7", "t1/c2"), prefix_len (its tokens: system + document, or
  system + the history before this turn), conversation and turn (chat only, else null and 0),
  input_ids, max_new_tokens, pinned, and cache_control when pinned.

The sample examples/data/tenant_trace.jsonl was made with the defaults but fewer requests:

    python scripts/gen_tenant_trace.py --requests 120 --out examples/data/tenant_trace.jsonl

(bench/kv_tiers.py calls make_trace() itself: its default run uses 360 requests, --quick 120).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "tenant_trace.jsonl"
PIN = {"type": "ephemeral", "ttl": "5m"}


@dataclass(frozen=True)
class TraceSpec:
    """The generator's settings (every field is also a --flag)."""

    seed: int = 33
    requests: int = 360
    tenants: int = 6
    docs_per_tenant: int = 10
    system_len: tuple[int, int] = (64, 256)  # tokens, rounded down to `align`
    doc_len: tuple[int, int] = (128, 640)
    question_len: tuple[int, int] = (4, 15)  # shorter than `align`: a doc prompt's full pages are its prefix
    chat_msg_len: tuple[int, int] = (8, 40)  # each user message and canned reply
    chat_turns: tuple[int, int] = (2, 5)
    upload_questions: tuple[int, int] = (1, 3)
    doc_share: float = 0.6  # of requests; uploads and chats share the rest
    upload_share: float = 0.15
    zipf_s: float = 1.1  # document popularity within a tenant
    tenant_zipf_s: float = 0.7
    pinned_tenants: int = 3  # tenants t0.. whose pin_ranks documents are pinned
    pin_ranks: tuple[int, ...] = (1, 4)  # popularity ranks (0: the most popular document)
    max_new_tokens: int = 4
    vocab: int = 1000
    align: int = 16
    rate: float = 20.0  # nominal arrivals per second (the `arrival` field)

    def __post_init__(self) -> None:
        if self.requests < 1 or self.tenants < 1 or self.docs_per_tenant < 1:
            raise ValueError("requests, tenants and docs_per_tenant must be >= 1")
        if not 0 <= self.doc_share + self.upload_share <= 1:
            raise ValueError("doc_share + upload_share must be within [0, 1]")
        if self.question_len[1] >= self.align:
            raise ValueError(f"question_len must stay below align ({self.align}) so pins cover only the prefix")
        if not all(0 <= r < self.docs_per_tenant for r in self.pin_ranks) or self.pinned_tenants > self.tenants:
            raise ValueError("pin_ranks must be document ranks and pinned_tenants at most tenants")
        for name in ("system_len", "doc_len", "question_len", "chat_msg_len", "chat_turns", "upload_questions"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 0 < lo <= hi, got {(lo, hi)}")


@dataclass
class _Tenant:
    name: str
    system: list[int]
    docs: list[list[int]]  # by popularity rank
    pinned_docs: tuple[int, ...]


def make_trace(spec: TraceSpec = TraceSpec()) -> list[dict]:
    """The trace's requests in arrival order (the same list for the same spec)."""
    rng = random.Random(spec.seed)
    tenants = [_tenant(rng, spec, t) for t in range(spec.tenants)]
    n_doc = round(spec.requests * spec.doc_share)
    n_upload = round(spec.requests * spec.upload_share)
    span = spec.requests / spec.rate
    events: list[tuple[float, dict]] = []
    events += [_doc_request(rng, spec, _pick(rng, tenants, spec.tenant_zipf_s), span) for _ in range(n_doc)]
    uploads = chats = 0
    while len(events) < n_doc + n_upload:
        events += _upload(rng, spec, _pick(rng, tenants, spec.tenant_zipf_s), uploads, span)
        uploads += 1
    while len(events) < spec.requests:
        events += _chat(rng, spec, _pick(rng, tenants, spec.tenant_zipf_s), chats, span)
        chats += 1
    events.sort(key=lambda e: e[0])
    return [{"id": i, "arrival": round(at, 3), **req} for i, (at, req) in enumerate(events[: spec.requests])]


def _ids(rng: random.Random, spec: TraceSpec, bounds: tuple[int, int], aligned: bool = False) -> list[int]:
    n = rng.randint(*bounds)
    if aligned:
        n = max(spec.align, n // spec.align * spec.align)
    return [rng.randrange(3, spec.vocab) for _ in range(n)]


def _tenant(rng: random.Random, spec: TraceSpec, t: int) -> _Tenant:
    system = _ids(rng, spec, spec.system_len, aligned=True)
    docs = [_ids(rng, spec, spec.doc_len, aligned=True) for _ in range(spec.docs_per_tenant)]
    return _Tenant(f"t{t}", system, docs, spec.pin_ranks if t < spec.pinned_tenants else ())


def _pick(rng: random.Random, items: list, s: float):
    return rng.choices(items, weights=[1 / (rank + 1) ** s for rank in range(len(items))])[0]


def _request(spec: TraceSpec, tenant: _Tenant, kind: str, prefix: str, shared: list[int], tail: list[int],
             pinned: bool = False, conversation: str | None = None, turn: int = 0) -> dict:
    req = {"tenant": tenant.name, "kind": kind, "prefix": prefix, "prefix_len": len(shared),
           "conversation": conversation, "turn": turn, "input_ids": shared + tail,
           "max_new_tokens": spec.max_new_tokens, "pinned": pinned}
    if pinned:
        req["cache_control"] = dict(PIN)
    return req


def _doc_request(rng: random.Random, spec: TraceSpec, tenant: _Tenant, span: float) -> tuple[float, dict]:
    d = _pick(rng, list(range(len(tenant.docs))), spec.zipf_s)
    req = _request(spec, tenant, "doc", f"{tenant.name}/d{d}", tenant.system + tenant.docs[d],
                   _ids(rng, spec, spec.question_len), pinned=d in tenant.pinned_docs)
    return rng.uniform(0, span), req


def _upload(rng: random.Random, spec: TraceSpec, tenant: _Tenant, u: int, span: float) -> list[tuple[float, dict]]:
    """A one-off document's burst of questions, a few requests' time apart."""
    doc, start = _ids(rng, spec, spec.doc_len, aligned=True), rng.uniform(0, span)
    return [(start + q * rng.uniform(2, 6) / spec.rate,
             _request(spec, tenant, "upload", f"{tenant.name}/u{u}", tenant.system + doc, _ids(rng, spec, spec.question_len)))
            for q in range(rng.randint(*spec.upload_questions))]


def _chat(rng: random.Random, spec: TraceSpec, tenant: _Tenant, c: int, span: float) -> list[tuple[float, dict]]:
    """One conversation; its turns come 5-15 requests' time apart (the previous turn has finished)."""
    name, history, at = f"{tenant.name}/c{c}", list(tenant.system), rng.uniform(0, span)
    out = []
    for k in range(rng.randint(*spec.chat_turns)):
        user = _ids(rng, spec, spec.chat_msg_len)
        out.append((at, _request(spec, tenant, "chat", name, history, user, conversation=name, turn=k)))
        history = history + user + _ids(rng, spec, spec.chat_msg_len)  # the canned reply
        at += rng.uniform(5, 15) / spec.rate
    return out


# -- figures of a trace ---------------------------------------------------------------------------


def page_keys(req: dict, page_size: int) -> list[bytes]:
    """A key per full page of req's prompt, each naming the tenant and every token up to its end."""
    h = hashlib.blake2b(req["tenant"].encode(), digest_size=16)
    keys, ids = [], req["input_ids"]
    for p in range(len(ids) // page_size):
        h.update(json.dumps(ids[p * page_size:(p + 1) * page_size]).encode())
        keys.append(h.copy().digest())
    return keys


def working_set_pages(trace: list[dict], page_size: int) -> int:
    """Distinct full prompt pages over the whole trace: what a cache holding every prefix holds."""
    return len({key for req in trace for key in page_keys(req, page_size)})


def prefix_pages(trace: list[dict], page_size: int) -> dict[str, int]:
    """Each distinct shared prefix (doc or upload: system + document) -> its full pages."""
    return {r["prefix"]: r["prefix_len"] // page_size for r in trace if r["kind"] != "chat"}


def to_jsonl(trace: list[dict]) -> str:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in trace)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(trace: list[dict], page_size: int = 16) -> dict:
    """Counts a reader checks a trace by: requests per kind and tenant, pinned, pages."""
    kinds: dict[str, int] = {}
    tenants: dict[str, int] = {}
    for r in trace:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
        tenants[r["tenant"]] = tenants.get(r["tenant"], 0) + 1
    return {"requests": len(trace), "kinds": kinds, "tenants": dict(sorted(tenants.items())),
            "pinned": sum(r["pinned"] for r in trace), "prompt_tokens": sum(len(r["input_ids"]) for r in trace),
            "distinct_prefixes": len(prefix_pages(trace, page_size)),
            "working_set_pages": working_set_pages(trace, page_size), "page_size": page_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in asdict(TraceSpec()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, tuple):
            ap.add_argument(flag, type=int, nargs="+", default=default)
        else:
            ap.add_argument(flag, type=type(default), default=default)
    ap.add_argument("--out", type=Path, default=SAMPLE)
    args = vars(ap.parse_args())
    out = args.pop("out")
    spec = TraceSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in args.items()})
    trace = make_trace(spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_jsonl(trace))
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB): {json.dumps(summary(trace))}")


if __name__ == "__main__":
    main()
