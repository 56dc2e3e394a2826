"""Composition roots: the process launcher (and, later, the HTTP server)."""
