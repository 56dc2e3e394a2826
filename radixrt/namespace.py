"""CacheNamespace: which prefix cache a request reads and fills.

Requests in different namespaces never share a KV page, in any tier: the radix tree
keeps one root per namespace (keyed by the value itself), and the lower tiers' content
keys are seeded by its `encoded` bytes (radixrt/cache/tier_index.py). The frontend
makes it from the request's cache_salt and extra_key (generate_input.cache_namespace);
the scheduler sets the rope mode of a longrope model's request (scheduler/req.py).

The empty namespace (no salt, no extra key, short rope, no tenant, no adapter) is the
default cache every request without a salt shares.

`encoded` is injective: a version byte, then every field in a fixed order, each one
self-delimiting (a presence byte, then a 4-byte length before the UTF-8 text; the rope
mode is one byte). No choice of salt can spell another namespace's bytes, as a
concatenation of the fields would ("ab" + "c" against "a" + "bc").
"""

from __future__ import annotations

import enum

import msgspec

ENCODING_VERSION = 1  # bumped whenever `encoded` changes: every content key changes with it


class RopeMode(enum.IntEnum):
    """The rope factors a longrope model computes a sequence's KV under: the same tokens have
    different KV under each, so the two never share pages. Every other model is SHORT."""

    SHORT = 0
    LONG = 1


class CacheNamespace(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One prefix-cache namespace (hashable: the radix tree's roots are keyed by it)."""

    salt: str | None = None  # the client's cache_salt, or its extra_key when it sent only that (SGLang's value)
    extra_key: str | None = None  # the extra_key sent beside a cache_salt (never alone: then it is `salt`)
    rope: RopeMode = RopeMode.SHORT  # a longrope model's request past its original context is LONG
    tenant: str | None = None  # room for the tenant a gateway names: tenants never share pages
    adapter: str | None = None  # room for a LoRA adapter's name: its KV is not the base model's

    def with_rope(self, rope: RopeMode) -> CacheNamespace:
        return msgspec.structs.replace(self, rope=rope)

    @property
    def encoded(self) -> bytes:
        """The unambiguous bytes of this namespace (see the module docstring): equal for equal
        namespaces, different for different ones."""
        return b"".join((bytes([ENCODING_VERSION]), _text(self.salt), _text(self.extra_key), bytes([self.rope]),
                         _text(self.tenant), _text(self.adapter)))


DEFAULT_NAMESPACE = CacheNamespace()


def _text(value: str | None) -> bytes:
    """A self-delimiting optional string: b"\\0" for None, else b"\\1", its length and its UTF-8 bytes."""
    if value is None:
        return b"\0"
    raw = value.encode("utf-8", "surrogatepass")  # the door refuses lone surrogates; nothing here may raise
    return b"\1" + len(raw).to_bytes(4, "big") + raw
