"""planner.memo.IdentityMemo: found by the owner's identity, never by an equal object, and bounded."""

from planner.memo import IdentityMemo


def test_a_value_is_found_for_the_same_owner_and_key_only():
    memo = IdentityMemo(kept=8)
    owner, twin = (1, 2, 3), tuple([1, 2, 3])  # equal, not the same object
    assert memo.put(owner, 4, "four") == "four"
    assert memo.get(owner, 4) == "four"
    assert memo.get(owner, 5) is None and memo.get(twin, 4) is None
    assert memo.get(owner) is None  # the key defaults to None, its own entry


def test_it_starts_again_past_its_bound_and_keeps_what_came_last():
    memo = IdentityMemo(kept=3)
    owners = [(i,) for i in range(4)]
    for n, owner in enumerate(owners):
        memo.put(owner, None, n)
    assert [memo.get(o) for o in owners] == [None, None, None, 3]
