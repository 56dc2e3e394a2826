"""The eviction policies (radixrt/cache/eviction.py, --radix-eviction-policy) and their order in the
device radix tree and in a lower tier's index alike: lru, lfu (SGLang's), and cost (greedy-dual over
hits x recompute cost)."""

from __future__ import annotations

import pytest

from radixrt.cache import RadixCache
from radixrt.cache.eviction import EvictionOrder, Stamp, relative_recompute_cost
from radixrt.cache.tier_index import TierIndex

PS = 2


def tree(policy: str) -> RadixCache:
    return RadixCache(PS, EvictionOrder(policy))


def add(cache: RadixCache, tokens: list[int], first_page: int) -> None:
    cache.insert(tokens, list(range(first_page, first_page + len(tokens) // PS)))


def evicted_first(cache: RadixCache) -> list[int]:
    return cache.evict(1)


def test_lru_gives_up_the_least_recently_used_leaf():
    c = tree("lru")
    add(c, [1, 1], 0)
    add(c, [2, 2], 1)
    c.match_prefix([1, 1, 9])  # 1 1 is now the most recent
    assert evicted_first(c) == [1]


def test_lfu_gives_up_the_least_hit_leaf_however_recent():
    c = tree("lfu")
    add(c, [1, 1], 0)
    add(c, [2, 2], 1)
    for _ in range(2):
        c.match_prefix([1, 1, 9])
    c.match_prefix([2, 2, 9])  # 2 2: the most recent, but hit once against twice
    assert evicted_first(c) == [1]
    assert evicted_first(c) == [0]


def test_cost_keeps_the_page_dearer_to_recompute_and_ages_old_hits_out():
    c = tree("cost")
    add(c, [5] * 8, 0)  # pages 0..3: one node from position 0
    add(c, [1, 1], 10)  # a shallow leaf, hit as often as the deep one below
    add(c, [5] * 8 + [6, 6], 0)  # a deep leaf (its page 4 is new: 4), at position 8
    c.match_prefix([1, 1, 9])
    c.match_prefix([5] * 8 + [6, 6, 9])
    assert evicted_first(c) == [10]  # same hits: the shallow page is cheaper to recompute
    assert evicted_first(c) == [4]
    order = EvictionOrder("cost")
    hot, fresh = Stamp(), Stamp()
    for _ in range(3):
        order.touch(hot, 1, 0, PS, hit=True)
    order.touch(fresh, 2, 0, PS, hit=True)
    assert order.key(hot) > order.key(fresh)  # three hits outweigh one
    for t in range(10):  # entries worth more than the hot one's three hits are evicted meanwhile
        gone = Stamp()
        order.touch(gone, 10 + t, 0, PS, hit=True)
        gone.worth = order.key(hot)[0] + 1
        order.evicted(gone)
    order.touch(fresh, 30, 0, PS, hit=True)  # one hit now is worth more than three long ago
    assert order.key(fresh) > order.key(hot)


def test_the_recompute_price_grows_with_the_position_by_the_models_attention_share():
    assert relative_recompute_cost(0, 16) < relative_recompute_cost(4096, 16) < relative_recompute_cost(8192, 16)
    # at the position where a token's attention costs as much as the rest of its forward, a page costs double
    assert relative_recompute_cost(1000 - 8, 16, attention_per_position=1 / 1000) == pytest.approx(16 * 2.0)


def test_a_lower_tier_orders_its_leaves_by_the_same_policy():
    for policy, first in (("lru", "a"), ("lfu", "b"), ("cost", "b")):
        idx = TierIndex(4, EvictionOrder(policy))
        idx.put("a", idx.take_free(), None, 0, PS)
        idx.put("b", idx.take_free(), None, 64, PS, hits=0)
        idx.get("a", hit=True)
        idx.get("a", hit=True)
        idx.get("b")  # b: the most recent, never hit
        assert idx.victim(False) == first, policy
