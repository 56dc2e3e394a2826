"""Bounded-KV retention, the scheduler's half (pure Python, no torch): a request keeps at most a
budget of KV pages and drops the rest as it grows.

  rules.py      RetentionRules: a request's settings resolved once at the door, or its refusal
  policies.py   one class per policy (POLICIES): its page budget and the order its pages leave in
  drop_plan.py  a step's drops on a request's page table (KVMemory's retention part)
  counters.py   the policies' counters for the scheduler's stats

Its settings (RetentionPolicy, the server's flags, a request's override, their checks) are
radixrt/settings/retention.py.

The worker's half, which needs tensors, is radixrt/worker/retention_tensors.py (sink keys,
positions past the rope tables, attention mass); docs/architecture.md, "Bounded KV retention".
"""
