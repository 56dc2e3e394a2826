"""The HTTP front door: the app, its API keys and error handling, and /openapi.json.

create_app puts SGLang's native API (native_api.py, lora_api.py, tokenize_api.py) and the
OpenAI one (openai_api.py) behind one middleware; both are built from http_common.py.
Every handler reads its body under --max-request-bytes, decodes it into a
typed struct (radixrt/server/schemas.py), has the door check and tokenize the
call in one pass (frontend/intake.py, off the event loop), submits it through
the TokenizerManager and awaits its requests on the event loop (the manager's receiving thread wakes it). A client that goes
away aborts its requests, so their pages come back. Keys: access.py; a route
that takes no key refuses what a web page could send instead (browser_guard.py).

Errors: a RequestError (the client's mistake) is a 400 naming the field; a
request that failed in the backend is its status (500 our bug, 503 the backend
is gone or shutting down), as an error event once a stream has started; any
other exception is a 500 with its traceback logged, never a dead server.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.errors import RequestError
from radixrt.frontend.tokenizer_manager import BackendDied
from radixrt.server.access import authorize, bearer_matches, required_key  # noqa: F401 - also imported from here
from radixrt.server.browser_guard import BrowserGuard
from radixrt.server.http_common import ApiError, ServerContext, counted, error_response, internal_error
from radixrt.server.lora_api import add_lora_routes
from radixrt.server.native_api import add_native_routes
from radixrt.server.openai_api import add_openai_routes
from radixrt.server.schemas import openapi_schemas
from radixrt.server.readout_api import add_readout_routes, refuse_generation
from radixrt.server.tokenize_api import add_tokenize_routes

logger = logging.getLogger(__name__)


def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="radixrt", version=ctx.version)
    app.state.ctx = ctx
    browser = BrowserGuard(ctx.http)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        access = authorize(request.url.path, request.method, request.headers.get("authorization"), ctx.http, ctx.keys)
        if not access.allowed:
            return _answer(ctx, ApiError(401, "invalid or missing API key", type="authentication_error", cause="auth"))
        request.state.tenant = access.tenant
        if (refused := refuse_generation(ctx, request.url.path)) is not None:
            return _answer(ctx, refused)
        refused = None if access.needs_key else browser.refusal(request.method, request.url.path, request.headers)
        if refused is not None:  # a route without a key: what a web page could send is refused
            return _answer(ctx, refused)
        try:
            return await call_next(request)
        except ApiError as e:
            return _answer(ctx, e)
        except RequestError as e:
            return _answer(ctx, ApiError(e.status, e.message, e.param))
        except BackendDied as e:
            return _answer(ctx, ApiError(503, f"the backend died: {e}", type="server_error", cause="backend_died"))
        except TimeoutError as e:
            return _answer(ctx, ApiError(503, str(e), type="server_error", cause="timeout"))
        except Exception as e:  # noqa: BLE001 - a bug: logged with its traceback, answered, survived
            logger.exception("internal error on %s %s", request.method, request.url.path)
            return _answer(ctx, internal_error(e))

    add_native_routes(app, ctx)
    add_openai_routes(app, ctx)
    add_lora_routes(app, ctx)
    add_tokenize_routes(app, ctx)
    add_readout_routes(app, ctx)
    install_openapi(app)
    return app


def _answer(ctx: ServerContext, err: ApiError) -> Response:
    """The error's answer, counted in /metrics by status and cause."""
    return error_response(counted(ctx, err))


def install_openapi(app: FastAPI) -> None:
    """Publish the typed request bodies in /openapi.json (routes read raw bodies, so FastAPI
    cannot infer them); generated once from the same structs the routes decode into."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = default()
            _, components = openapi_schemas()
            spec.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
