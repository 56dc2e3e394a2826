"""What prefill-only entries read out of a step's forward instead of a sample (messages.Readout):
the final hidden states after the model's last norm, pooled (embeddings), the logprobs of label
tokens after the last row (scores), or a classification head's outputs. Rank 0 reads them, after
the forward every rank ran; each is float32 bytes.

"mean" returns the sum of the chunk's rows (the scheduler adds the chunks up and divides by the
prompt's length); "last" and "labels" come with the last chunk and "cls" with the first.
"""

from __future__ import annotations

import torch

from radixrt.messages import BatchEntry
from radixrt.worker.logprobs import LogitRows


def read_outs(entries: list[BatchEntry], hidden: torch.Tensor, model: torch.nn.Module, rows: LogitRows,
              logits: torch.Tensor, failed: dict[int, str]) -> list[bytes]:
    """Per entry its readout (b"" for none, or a failed entry); [] when no entry has one.
    hidden: [T, hidden] the step's final hidden states before the norm; logits: rows.rows' logits."""
    if not any(e.readout is not None for e in entries):
        return []
    pooled = _pooled(entries, hidden, model, failed)
    values: dict[int, torch.Tensor] = {}  # entry index -> its values, on the device
    for i, e in enumerate(entries):
        if e.readout is None or i in failed:
            continue
        if e.readout.kind == "labels":
            ids = torch.tensor(e.readout.label_ids, dtype=torch.int64, device=logits.device)
            values[i] = torch.log_softmax(logits[rows.entry_labels[i]], dim=-1)[ids]
        else:
            values[i] = pooled[i]
    if not values:
        return [b""] * len(entries)
    flat = torch.cat([v.float() for v in values.values()]).cpu().numpy()  # one copy to the host for the step
    out, at = [b""] * len(entries), 0
    for i, v in values.items():
        out[i] = flat[at : at + v.numel()].tobytes()
        at += v.numel()
    return out


def _pooled(entries: list[BatchEntry], hidden: torch.Tensor, model: torch.nn.Module,
            failed: dict[int, str]) -> dict[int, torch.Tensor]:
    """Entry index -> its pooled vector (for "head": the head's outputs), every pooling entry's rows
    through the norm in one call and summed per entry in one index_add."""
    rows: list[int] = []
    segment: list[int] = []
    members: list[int] = []  # entry index of each segment
    head: list[int] = []  # segments whose vector goes through the classification head
    offset = 0
    for i, e in enumerate(entries):
        n = len(e.input_ids)
        kind = e.readout.kind if e.readout is not None and i not in failed else None
        if kind in ("last", "mean", "cls", "head"):
            take = {"last": [offset + n - 1], "head": [offset + n - 1], "cls": [offset],
                    "mean": list(range(offset, offset + n))}[kind]
            rows += take
            segment += [len(members)] * len(take)
            if kind == "head":
                head.append(len(members))
            members.append(i)
        offset += n
    if not members:
        return {}
    dev = hidden.device
    normed = model.norm(hidden[torch.tensor(rows, dtype=torch.int64, device=dev)]).float()  # [R, hidden]
    sums = torch.zeros(len(members), normed.shape[1], dtype=torch.float32, device=dev)
    sums.index_add_(0, torch.tensor(segment, dtype=torch.int64, device=dev), normed)
    out = {i: sums[k] for k, i in enumerate(members)}
    if head:
        scores = model.classify(sums[torch.tensor(head, dtype=torch.int64, device=dev)])  # [H, num_labels]
        out.update((members[k], s) for k, s in zip(head, scores))
    return out
