"""`engine.gc_freeze.frozen_gc`: the objects that exist when a rollout starts are out of Python's
collections while it runs (no full collection of the whole heap inside a step), and are
collectable again once it returns; nested and concurrent users share one freeze."""
import gc
import threading
import weakref

import pytest

from das_jax.engine import scheduler
from das_jax.engine.gc_freeze import frozen_gc
from das_jax.engine.generate import EngineConfig, Request


class _Node:
    def __init__(self):
        self.other = None


def _cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


def _frozen(obj) -> bool:
    """A tracked object is frozen when it is in none of the collector's generations."""
    assert gc.is_tracked(obj)
    return not any(o is obj for o in gc.get_objects())


def test_cyclic_garbage_from_before_is_kept_inside_and_collected_after():
    base = gc.get_freeze_count()
    a, alive = _cycle()
    with frozen_gc():
        assert _frozen(a)
        del a
        gc.collect()
        assert alive() is not None         # frozen: the collection skipped it
        b, young = _cycle()
        del b
        gc.collect()
        assert young() is None             # made inside: collected as usual
    assert gc.get_freeze_count() == base
    gc.collect()
    assert alive() is None                 # back in the oldest generation: collected


def test_nested_and_concurrent_users_share_one_freeze_and_errors_unfreeze():
    base = gc.get_freeze_count()
    before = []
    with frozen_gc():
        assert _frozen(before)
        inside = []
        with frozen_gc():
            assert not _frozen(inside)                 # not frozen again
        assert _frozen(before) and not _frozen(inside)   # the outer one still holds it
    assert not _frozen(before) and gc.get_freeze_count() == base
    entered, leave = threading.Event(), threading.Event()

    def other():
        with frozen_gc():
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    entered.wait(10)
    with frozen_gc():
        pass
    assert _frozen(before)                             # the other thread's freeze stays
    leave.set()
    t.join()
    assert not _frozen(before) and gc.get_freeze_count() == base
    with pytest.raises(RuntimeError):
        with frozen_gc():
            assert _frozen(before)
            raise RuntimeError("step failed")
    assert not _frozen(before) and gc.get_freeze_count() == base


class _Executor:
    """A model-free executor (one token per row per step) that records the freeze count the
    scheduler calls it under."""

    def __init__(self):
        self.seen = []

    def start(self, batch, cache_len):
        pass

    def prefill(self, request_ids, rows, batch):
        self.seen.append(gc.get_freeze_count())
        return scheduler.Prefilled([7] * len(request_ids), [0.0] * len(request_ids), 0.0,
                                   len(request_ids))

    def compact(self, live, new_batch):
        pass

    def verify(self, st):
        self.seen.append(gc.get_freeze_count())
        toks = [[7] for _ in st.live]
        return scheduler.StepOutput.from_rows(toks, [[0.0] for _ in toks], 0.0)


def test_run_schedule_runs_its_steps_frozen_and_unfreezes_after():
    ex = _Executor()
    base = gc.get_freeze_count()
    ec = EngineConfig(max_slots=2, max_cache_len=64)
    outs, _ = scheduler.run_schedule([Request((2, 3), problem_id=i) for i in range(3)], ex, ec,
                                     scheduler.Limits(4))
    assert [len(o.token_ids) for o in outs] == [4, 4, 4]
    assert ex.seen and min(ex.seen) > base
    assert gc.get_freeze_count() == base
