"""The worker: owns the KV bytes, the model, and sampling; runs one batch per step."""
