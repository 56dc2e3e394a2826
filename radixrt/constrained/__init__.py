"""Constrained decoding: grammars (regex, JSON schema, EBNF) compiled with xgrammar and the
matchers that say which tokens may come next. Used by the frontend (to check a grammar at
the door) and by the scheduler (which owns each request's matcher)."""
