"""Server settings, one module per feature, one pattern.

Each module holds one feature's flags as a frozen dataclass (`ModelArgs`, `LoraArgs`, ...):
SGLang's field names, each with its default and help text (the CLI is generated from them,
radixrt/cli_args.py), a `check` that validates them (ValueError naming the flag), and the
settings derived from them (`LoraArgs.lora`, `HiCacheArgs.mooncake`, ...), beside what else the
feature reads at start (adapter configs, a pooler, tenants' keys). `radixrt.config.ServerArgs`
assembles them: it inherits every feature's fields, runs each `check` in turn, then the few
rules that tie two features together. Nothing here imports the runtime: settings are L0.
"""
