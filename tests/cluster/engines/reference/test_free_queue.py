"""FreeBlockQueue: LRU order, O(1) unlink from the middle, against a plain list model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engines.reference.free_queue import EMPTY, FreeBlockQueue


def test_starts_full_in_id_order() -> None:
    q = FreeBlockQueue(5)
    assert list(q) == [0, 1, 2, 3, 4]
    assert len(q) == 5
    assert q.peek() == 0
    q.check()


def test_starts_empty_when_asked() -> None:
    q = FreeBlockQueue(3, full=False)
    assert list(q) == []
    assert len(q) == 0
    assert q.popleft() == EMPTY
    assert q.peek() == EMPTY
    assert 1 not in q
    q.check()


def test_popleft_takes_least_recently_appended() -> None:
    q = FreeBlockQueue(4)
    taken = [q.popleft() for _ in range(4)]
    assert taken == [0, 1, 2, 3]
    assert q.popleft() == EMPTY
    for b in (2, 0, 3):
        q.append(b)
    assert [q.popleft() for _ in range(3)] == [2, 0, 3]


def test_remove_from_middle_keeps_order_of_the_rest() -> None:
    q = FreeBlockQueue(6)
    q.remove(3)
    q.remove(0)
    q.remove(5)
    assert list(q) == [1, 2, 4]
    assert 3 not in q and 1 in q
    q.append(3)
    q.appendleft(5)
    assert list(q) == [5, 1, 2, 4, 3]
    q.check()


def test_last_element_round_trip() -> None:
    q = FreeBlockQueue(1)
    q.remove(0)
    assert len(q) == 0 and list(q) == []
    q.appendleft(0)
    assert list(q) == [0]
    q.check()


def test_misuse_is_refused_not_corrupting() -> None:
    q = FreeBlockQueue(3)
    with pytest.raises(RuntimeError, match="already in the free queue"):
        q.append(1)
    with pytest.raises(RuntimeError, match="already in the free queue"):
        q.appendleft(2)
    q.remove(1)
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(1)
    assert list(q) == [0, 2]
    q.check()
    with pytest.raises(ValueError):
        FreeBlockQueue(-1)


def test_zero_blocks() -> None:
    q = FreeBlockQueue(0)
    assert len(q) == 0 and q.popleft() == EMPTY and list(q) == []
    q.check()


ops = st.lists(st.tuples(st.sampled_from(["popleft", "append", "appendleft", "remove"]),
                         st.integers(0, 15)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 16), full=st.booleans(), script=ops)
def test_matches_list_model(num_blocks: int, full: bool, script: list[tuple[str, int]]) -> None:
    q = FreeBlockQueue(num_blocks, full=full)
    model = list(range(num_blocks)) if full else []
    for op, arg in script:
        b = arg % num_blocks
        if op == "popleft":
            assert q.popleft() == (model.pop(0) if model else EMPTY)
        elif op in ("append", "appendleft"):
            if b in model:
                with pytest.raises(RuntimeError):
                    getattr(q, op)(b)
            elif op == "append":
                q.append(b)
                model.append(b)
            else:
                q.appendleft(b)
                model.insert(0, b)
        elif b in model:
            q.remove(b)
            model.remove(b)
        else:
            with pytest.raises(RuntimeError):
                q.remove(b)
        assert len(q) == len(model)
        assert q.peek() == (model[0] if model else EMPTY)
    assert list(q) == model
    assert all((b in q) == (b in model) for b in range(num_blocks))
    q.check()
