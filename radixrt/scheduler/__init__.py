"""The scheduler: owns requests, page bookkeeping and the batch decision (pure Python, no tensors)."""
