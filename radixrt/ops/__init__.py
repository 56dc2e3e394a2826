"""Operator tools run from the command line: capacity estimate, cache-hit diagnosis, tuning."""
