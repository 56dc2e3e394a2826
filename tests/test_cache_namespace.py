"""CacheNamespace (radixrt/namespace.py): two namespaces whose strings would concatenate alike (a salt
and an extra key split differently, a salt spelled like a rope-mode prefix or a JSON pair, a tenant
beside a salt) never share a page in any tier (the device's radix tree, host memory, disk), and the
encoding that seeds the tiers' content keys is injective. The door keeps SGLang's meaning of a lone
cache_salt or extra_key."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.scheduling import assert_idle_pool, make

from radixrt.cache.tier_index import namespace_id, page_keys
from radixrt.frontend.generate_input import cache_namespace
from radixrt.messages import TokenizedRequest
from radixrt.namespace import DEFAULT_NAMESPACE, ENCODING_VERSION, CacheNamespace, RopeMode
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.step import drive

LONG = RopeMode.LONG
# Each group: namespaces a concatenation of their strings (SGLang's salt + extra key, the rope-mode
# prefixes "S+"/"L"/"L+" and the JSON pair this runtime used before) could not tell apart.
ALIKE = {
    "salt+extra": [CacheNamespace(salt="ab", extra_key="c"), CacheNamespace(salt="a", extra_key="bc"),
                   CacheNamespace(salt="abc")],
    "rope prefix": [CacheNamespace(salt="S+x"), CacheNamespace(salt="x"), CacheNamespace(salt="x", rope=LONG),
                    CacheNamespace(salt="L+x")],
    "bare rope": [CacheNamespace(rope=LONG), CacheNamespace(salt="L"), DEFAULT_NAMESPACE],
    "json pair": [CacheNamespace(salt='["ten", "ant"]'), CacheNamespace(salt="ten", extra_key="ant")],
    "tenant, adapter": [CacheNamespace(tenant="a", salt="b"), CacheNamespace(salt="ab"), CacheNamespace(adapter="ab"),
                        CacheNamespace(tenant="ab")],
}
PAGE = 4
DOC = [(7 * i + 3) % 45 for i in range(60)]  # 15 pages, in the fake worker's vocabulary
ONE_TOKEN = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0)
TIERS = {  # where the first namespace's pages are when the others ask: device pages, FakeWorker tiers
    "device": (128, {}),
    "host": (24, {"host_pages": 200}),
    "disk": (24, {"host_pages": 2, "disk_pages": 200}),  # host memory spills to disk at once
}
_rids = itertools.count()
PROPERTY = settings(deadline=None, derandomize=True)  # a loaded CI machine must not fail it on time


# -- the encoding -----------------------------------------------------------------------------

names = st.one_of(st.none(), st.text(alphabet='ab+SL["\0\x01', max_size=3))
namespaces = st.builds(CacheNamespace, salt=names, extra_key=names, rope=st.sampled_from(RopeMode), tenant=names,
                       adapter=names)


@PROPERTY
@given(namespaces, namespaces)
def test_the_encoding_is_injective(a, b):
    assert (a.encoded == b.encoded) == (a == b)
    assert a.encoded[0] == ENCODING_VERSION
    if a == b:
        assert hash(a) == hash(b)  # one radix root per namespace


@PROPERTY
@given(st.text(max_size=6), st.integers(0, 6), st.integers(0, 6))
def test_every_split_of_one_string_is_its_own_namespace(text, i, j):
    i, j = min(i, len(text)), min(j, len(text))
    a = CacheNamespace(salt=text[:i], extra_key=text[i:])
    b = CacheNamespace(salt=text[:j], extra_key=text[j:])
    assert (a.encoded == b.encoded) == (i == j)


salts = st.one_of(st.none(), st.text(alphabet='ab["', max_size=3))


@PROPERTY
@given(salts, salts, salts, salts)
def test_the_door_keeps_a_lone_value_as_sglang_and_a_pair_apart(s1, k1, s2, k2):
    def meaning(salt, key):  # SGLang: one value alone is itself, whichever field it came in
        return ("pair", salt, key) if salt and key else ("one", salt or key or None)

    assert (cache_namespace(s1, k1) == cache_namespace(s2, k2)) == (meaning(s1, k1) == meaning(s2, k2))
    assert cache_namespace(s1, k1).rope is RopeMode.SHORT  # the scheduler alone sets the rope mode


@pytest.mark.parametrize("group", ALIKE.values(), ids=ALIKE.keys())
def test_alike_namespaces_share_no_content_key(group):
    keys = [page_keys(DOC, PAGE, ns.encoded) for ns in group]
    assert len({namespace_id(ns.encoded) for ns in group}) == len(group)
    for a, b in itertools.combinations(keys, 2):
        assert not set(a) & set(b)


# -- through the scheduler: device, host and disk tiers ------------------------------------------


def ask(s, w, namespace: CacheNamespace, prompt: list[int]) -> int:
    """Run prompt in namespace to its end; the prompt tokens it found cached (in any tier)."""
    rid = f"r{next(_rids)}"
    s.add_request(TokenizedRequest(rid, prompt, ONE_TOKEN, namespace=namespace))
    return max(o.cached_tokens for o in drive(s, w) if o.rid == rid)


def push_below(s, w, namespace: CacheNamespace, tier: str) -> None:
    """Run other prompts until none of namespace's pages of DOC is on the device (nor, for the disk
    tier, in host memory): each has gone down to `tier`."""
    tiers = s.mem.tiers
    for k in range(12):
        on_device = s.mem.cache.match_prefix(DOC, namespace, touch=False).pages
        in_host = tiers.host.keys_of(namespace.encoded)
        if not on_device and (tier == "host" or not in_host):
            break
        ask(s, w, DEFAULT_NAMESPACE, [(11 * k + i) % 45 + 1 for i in range(60)])
    below = tiers.host if tier == "host" else tiers.disk
    assert len(below.keys_of(namespace.encoded)) == len(DOC) // PAGE, tier


@pytest.mark.parametrize("group", ALIKE.values(), ids=ALIKE.keys())
@pytest.mark.parametrize("tier", TIERS)
def test_alike_namespaces_never_share_a_page_in_any_tier(tier, group, tmp_path):
    num_pages, tiers = TIERS[tier]
    if "disk_pages" in tiers:
        tiers = {**tiers, "disk_dir": str(tmp_path)}
    s, w = make(num_pages, PAGE, tiers, enable_hierarchical_cache=bool(tiers))
    first, others = group[0], group[1:]
    assert ask(s, w, first, DOC) == 0
    if tier != "device":
        push_below(s, w, first, tier)
    loaded = (s.stats().host_hit_pages, s.stats().disk_hit_pages)
    for ns in others:
        assert ask(s, w, ns, DOC) == 0, ns
    assert (s.stats().host_hit_pages, s.stats().disk_hit_pages) == loaded  # nothing came up from below
    assert ask(s, w, first, DOC) >= len(DOC) - PAGE  # its own pages are there (all but the last, always computed)
    if tier != "device":
        got = {"host": s.stats().host_hit_pages - loaded[0], "disk": s.stats().disk_hit_pages - loaded[1]}
        assert got[tier] > 0, got
    assert_idle_pool(s)
