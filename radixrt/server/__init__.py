"""Composition roots: the process launcher, the HTTP server (shared plumbing, native and OpenAI routes), metrics."""
