"""The command line generated from ServerArgs: one --flag per field, its help from the field."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from radixrt.config import ServerArgs

_TYPES = {"int": int, "float": float, "str": str}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        kind = str(f.type).replace(" | None", "")
        if kind == "bool":
            parser.add_argument(flag, action="store_true", help=help_text)
        elif kind == "list[str]":  # SGLang's nargs="*" lists (--lora-paths A=x B=y)
            parser.add_argument(flag, nargs="*", type=str, default=None, help=help_text)
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
            if "default" not in help_text:
                help_text = f"{help_text} (default: {default})"
            parser.add_argument(flag, type=_TYPES[kind], default=default, required=f.name == "model_path", help=help_text)


def server_args_from(ns: argparse.Namespace) -> ServerArgs:
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    values: dict[str, Any] = {k: v for k, v in vars(ns).items() if k in fields}
    return ServerArgs(**values)
