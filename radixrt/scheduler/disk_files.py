"""The disk tier's directory as the scheduler sees it: which page files are there (rank 0's stand
for every rank's), and whether one still is. The worker owns the bytes (worker/disk_tier.py)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from radixrt.messages import disk_page_name

logger = logging.getLogger(__name__)


def page_files(d: Path) -> list[Path]:
    """Rank 0's page files in d (they stand for all ranks'), oldest first, after removing the
    temporary files of writes a crash cut short. A directory that cannot be read holds none."""
    found: list[tuple[float, Path]] = []
    try:
        for f in d.glob(disk_page_name("*")):
            with contextlib.suppress(FileNotFoundError):  # removed while listed
                found.append((f.stat().st_mtime, f))
        for tmp in d.glob("*.tmp*"):
            tmp.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("cannot read the disk KV tier's directory %s: %s", d, e)
    return [f for _, f in sorted(found)]


def exists(path: Path) -> bool:
    """Whether path is there; one that cannot be looked at (permissions, I/O) is not."""
    try:
        return path.exists()
    except OSError:
        return False
