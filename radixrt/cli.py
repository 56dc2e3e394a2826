"""The `radixrt` command: `radixrt launch_server --model-path DIR [...]`."""

from __future__ import annotations

import sys

COMMANDS = ("launch_server",)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: radixrt {{{','.join(COMMANDS)}}} [--help]", file=sys.stderr)
        return 2
    from radixrt.launch_server import main as launch

    return launch(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
