"""The workloads of bench/speculative.py, seeded, as prompt token ids of the model's own tokenizer
(chat template applied here, so the server never re-tokenizes and prompt lengths are exact).

  doc_qa     (copy-heavy) a ~850-token document of prose sentences (SENTENCES, shuffled per
             document, 4 questions per document) + "quote the sentence that mentions X and the
             two after it": the answer is spans of the prompt, the case n-gram drafting is for.
  code_edit  (copy-heavy) a 55-75-line Python module (CODE_BLOCKS, 7 drawn per snippet, one
             variable name throughout) + "rewrite it renaming `old` to `new`".
  multiturn  chats over a ~400-token document: turn 1 carries the document and a question, each
             later turn the whole conversation so far (the model's replies, cut at its first
             EOS, as assistant messages) and a new question, quoting or explaining.
  unique     /work/shared/peers/workloads.py's W2_unique: 200-800-token windows of tokenized
             stdlib text, raw ids without a chat template (past its 64 prompts, more by the same
             recipe from another seed).
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spec_texts import CODE_BLOCKS, CODE_HEADER, RENAMES, SENTENCES

PEER_WORKLOADS = Path("/work/shared/peers/workloads.py")
SEED = 7
DOC_SENTENCES = 26  # doc_qa: ~850 tokens with the SmolLM2 tokenizer
CHAT_DOC_SENTENCES = 12  # multiturn: ~400 tokens
QUESTIONS_PER_DOC = 4
CODE_FUNCS = 7


@dataclass(frozen=True)
class Template:
    """The model's tokenizer and chat template: messages -> prompt ids, output ids -> reply text."""

    tokenizer: Any  # a transformers tokenizer

    @classmethod
    def load(cls, model_dir: Path) -> Template:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    def ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def reply(self, output_ids: list[int]) -> str:
        """The reply as the chat's history keeps it: up to the first EOS (outputs run on past it:
        the bench sets ignore_eos)."""
        eos = self.tokenizer.eos_token_id
        cut = output_ids.index(eos) if eos in output_ids else len(output_ids)
        return self.tokenizer.decode(output_ids[:cut], skip_special_tokens=True).strip()


@dataclass(frozen=True)
class Workload:
    """One workload's requests: `prompts` (sent independently) or `chats` (each a list of user
    messages, sent turn after turn, each turn's prompt built from the replies so far)."""

    name: str
    about: str
    max_new: int
    copy_heavy: bool
    prompts: tuple[tuple[int, ...], ...] = ()
    chats: tuple[tuple[str, ...], ...] = ()

    @property
    def is_chat(self) -> bool:
        return bool(self.chats)

    def longest_prompt(self, template: Template) -> int:
        """Prompt tokens of the longest request (a chat's last turn is bounded: every earlier
        reply counted at max_new tokens plus a few for its template)."""
        if not self.is_chat:
            return max(len(p) for p in self.prompts)
        return max(len(template.ids([{"role": "user", "content": "\n\n".join(c)}])) + len(c) * (self.max_new + 16)
                   for c in self.chats)


# -- doc_qa and multiturn: prose --------------------------------------------------------------


def document(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """n (keyword, sentence) pairs in a seeded order."""
    return rng.sample(SENTENCES, n)


def as_text(sentences: list[tuple[str, str]]) -> str:
    """Paragraphs of four sentences."""
    paras = [" ".join(s for _, s in sentences[i : i + 4]) for i in range(0, len(sentences), 4)]
    return "\n\n".join(paras)


def quote_question(keyword: str) -> str:
    return (f'Quote, word for word, the sentence of the document that mentions "{keyword}", '
            "then the two sentences that follow it. Give only the quoted sentences.")


def doc_qa(template: Template, n: int, max_new: int) -> Workload:
    rng, prompts = random.Random(SEED), []
    while len(prompts) < n:
        doc = document(rng, DOC_SENTENCES)
        for keyword, _ in rng.sample(doc[:-2], QUESTIONS_PER_DOC):  # two sentences follow each
            content = f"Here is a document.\n\n{as_text(doc)}\n\n{quote_question(keyword)}"
            prompts.append(tuple(template.ids([{"role": "user", "content": content}])))
    return Workload("doc_qa", f"{DOC_SENTENCES}-sentence documents, {QUESTIONS_PER_DOC} quote questions each",
                    max_new, True, prompts=tuple(prompts[:n]))


def multiturn(n_chats: int, turns: int, max_new: int) -> Workload:
    rng, chats = random.Random(SEED + 1), []
    for _ in range(n_chats):
        doc = document(rng, CHAT_DOC_SENTENCES)
        keywords = [k for k, _ in rng.sample(doc[:-2], turns)]
        asks = [quote_question(k) if t % 2 == 0 else f'Explain in your own words what the document says about "{k}".'
                for t, k in enumerate(keywords)]
        chats.append((f"Read this document.\n\n{as_text(doc)}\n\n{asks[0]}", *asks[1:]))
    return Workload("multiturn", f"{n_chats} chats x {turns} turns over {CHAT_DOC_SENTENCES}-sentence documents",
                    max_new, False, chats=tuple(chats))


# -- code_edit ----------------------------------------------------------------------------------


def code_edit(template: Template, n: int, max_new: int) -> Workload:
    rng, prompts = random.Random(SEED + 2), []
    for _ in range(n):
        old, new = rng.choice(RENAMES)
        blocks = rng.sample(CODE_BLOCKS, CODE_FUNCS)
        code = (CODE_HEADER + "\n\n\n" + "\n\n\n".join(blocks)).replace("VAR", old)
        content = (f"Rewrite this code with one change: rename the variable `{old}` to `{new}` everywhere, "
                   f"function names included. Output only the rewritten code.\n\n```python\n{code}\n```")
        prompts.append(tuple(template.ids([{"role": "user", "content": content}])))
    return Workload("code_edit", f"{CODE_FUNCS}-function Python modules, one variable renamed", max_new, True,
                    prompts=tuple(prompts))


# -- unique: the peers' W2 -------------------------------------------------------------------------


def peer_workloads() -> Any:
    """/work/shared/peers/workloads.py, imported by path (it is not a package)."""
    spec = importlib.util.spec_from_file_location("peer_workloads", PEER_WORKLOADS)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(PEER_WORKLOADS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unique(model_dir: Path, n: int, max_new: int) -> Workload:
    W = peer_workloads()
    prompts = [tuple(p) for p in W.make_workloads(str(model_dir))["W2_unique"]["prompts"]][:n]
    if len(prompts) < n:  # W2's recipe (lengths drawn first, then windows) from another seed
        more = W._Sampler(W.corpus_ids(str(model_dir)), W.SEED + 102)
        lens = [more.rng.randint(200, 800) for _ in range(n - len(prompts))]
        prompts += [tuple(more.window(k)) for k in lens]
    return Workload("unique", "peers' W2_unique: 200-800-token unrelated windows of stdlib text, raw ids",
                    max_new, False, prompts=tuple(prompts))


def build(model_dir: Path, template: Template, requests: int, chats: int, turns: int, max_new: dict[str, int],
          names: tuple[str, ...]) -> dict[str, Workload]:
    """The named workloads: `requests` requests each, multiturn `chats` chats of `turns` turns."""
    makers = {
        "doc_qa": lambda: doc_qa(template, requests, max_new["doc_qa"]),
        "code_edit": lambda: code_edit(template, requests, max_new["code_edit"]),
        "multiturn": lambda: multiturn(chats, turns, max_new["multiturn"]),
        "unique": lambda: unique(model_dir, requests, max_new["unique"]),
    }
    return {name: makers[name]() for name in names}
