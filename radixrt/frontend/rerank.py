"""/v1/rerank's two ways of scoring a document, as SGLang 0.5.9 chooses between them:

- a decoder reranker (Qwen3-Reranker's kind), recognised by its chat template, which asks for a
  "yes" or "no": each (query, document) is rendered through that template (with `instruct`) and
  scored p(yes) / (p(yes) + p(no)) from the next token's probabilities, on a generating server;
- a cross-encoder: a checkpoint with a classification head (…ForSequenceClassification), whose
  output for the query and document encoded as a pair is the score.

Anything else is refused with what it would take. The answers are SGLang's: documents sorted by
score, best first, cut to top_n, each with its index (and its text with return_documents).
"""

from __future__ import annotations

from typing import Any

from radixrt.errors import RequestError


def is_reranker_template(template: str | None) -> bool:
    """SGLang's test: a template that says the answer can only be "yes" or "no"."""
    if not template:
        return False
    t = template.lower()
    return "answer can only be" in t and '"yes"' in t and '"no"' in t


def content_text(content: Any, field: str) -> str:
    """A query's or document's text: the string, or its text parts joined by spaces (SGLang's)."""
    if isinstance(content, str):
        text = content
    else:
        if any(p.type != "text" for p in content):
            raise RequestError(f"{field}: only text parts are supported (no images or videos)", field)
        text = " ".join(p.text or "" for p in content)
    if not text.strip():
        raise RequestError(f"{field} cannot be empty or whitespace only", field)
    return text


def render_prompts(template: str, query: str, documents: list[str], instruct: str | None) -> list[str]:
    """Each document's prompt: the template over [query, document] as two user messages, as
    SGLang renders it (a plain jinja2 environment)."""
    import jinja2

    compiled = jinja2.Environment(loader=jinja2.BaseLoader(), autoescape=False).from_string(template)
    extra = {"instruct": instruct} if instruct else {}
    return [compiled.render(messages=[{"role": "user", "content": query}, {"role": "user", "content": d}], **extra)
            for d in documents]


def yes_no_ids(tokenizer: Any) -> tuple[int, int]:
    """The ids of "yes" and "no" (SGLang's lookup); a tokenizer without single tokens for them
    cannot rerank this way."""
    yes, no = tokenizer.encode("yes", add_special_tokens=False), tokenizer.encode("no", add_special_tokens=False)
    if len(yes) == 1 and len(no) == 1:
        return yes[0], no[0]
    ids = tokenizer.convert_tokens_to_ids(["yes", "no"])
    unk = getattr(tokenizer, "unk_token_id", None)
    if None in ids or unk in ids:
        raise RequestError("this reranker's tokenizer has no single tokens for \"yes\" and \"no\"", "query")
    return ids[0], ids[1]


def relevance(p_yes: float, p_no: float) -> float:
    total = p_yes + p_no
    return p_yes / total if total > 0 else 0.0


def ranked(scores: list[float], documents: list[str], top_n: int | None, return_documents: bool,
           metas: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """SGLang's RerankResponse list: best first, at most top_n."""
    out = []
    for i, s in enumerate(scores):
        item: dict[str, Any] = {"score": float(s), "index": i}
        if return_documents:
            item["document"] = documents[i]
        item["meta_info"] = metas[i] if metas is not None else None
        out.append(item)
    out.sort(key=lambda x: x["score"], reverse=True)
    return out[:top_n] if top_n is not None else out
