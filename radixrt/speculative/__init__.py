"""Speculative decoding's pure parts: the n-gram draft index and the choice of draft lengths
(its settings are radixrt/settings/speculative.py). Plain Python, no tensors: the scheduler owns drafting and acceptance
(scheduler/speculation.py), the worker verifies (worker/verify.py) and, for STANDALONE, drafts
with a small model (worker/draft_model.py)."""
