"""radixrt.lang: the frontend DSL, SGLang's semantics in a small design.

    import radixrt as rt

    @rt.function
    def qa(s, question):
        s += rt.user(question)
        s += rt.assistant(rt.gen("answer", max_tokens=64))

    rt.set_default_backend(rt.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="Why is the sky blue?")["answer"])

Modules: ir (expressions), primitives (gen/select/roles), constraints (what
gen's regex/json_schema/choices/dtype become), executor (a state's thread) and
interpreter (what each expression does to its text),
state (the `s` object and its fork branches), function (run, run_batch),
backend/ (RuntimeEndpoint over HTTP, Runtime = local server), chat_template and
chat_template_registry (roles, picked by model path as SGLang does), scoring and
choices (how select scores and decides). It talks to the runtime over HTTP only and never imports torch.
"""

from __future__ import annotations

from .backend import Runtime, RuntimeEndpoint, set_default_backend
from .chat_template import ChatTemplate
from .choices import greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized
from .errors import ProgramError, RuntimeEndpointError
from .function import Function, function
from .primitives import assistant, gen, select, separate_reasoning, system, user
from .state import ProgramState, ProgramStateGroup

__all__ = [
    "function", "gen", "select", "separate_reasoning", "system", "user", "assistant",
    "RuntimeEndpoint", "Runtime", "set_default_backend",
    "RuntimeEndpointError", "ProgramError", "ProgramState", "ProgramStateGroup", "Function", "ChatTemplate",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
]
