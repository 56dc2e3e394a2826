"""The `radixrt` command: `radixrt launch_server --model-path DIR [...]`, and the operator's tools
(`estimate`, `cache-report`, `tune`, `top`, in radixrt/ops/)."""

from __future__ import annotations

import importlib
import sys

# command -> the module whose main(argv) runs it (imported only when that command runs)
COMMANDS = {
    "launch_server": "radixrt.launch_server",
    "estimate": "radixrt.ops.estimate",
    "cache-report": "radixrt.ops.cache_report",
    "tune": "radixrt.ops.tune",
    "top": "radixrt.ops.top",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: radixrt {{{','.join(COMMANDS)}}} [--help]", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
