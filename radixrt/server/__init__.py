"""Composition root of the HTTP server: the app, its routes (native and OpenAI), shared plumbing, metrics and
uvicorn. It starts no process: radixrt/launch/ starts the processes and serves this over them."""
