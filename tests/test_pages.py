"""jpa.kv.pages: the device-side page allocator.

A sequential NumPy model of the allocator is the oracle (same pop/push order, so whole states
compare exactly); independent invariants are checked on the real state after every step; a toy
token cache checks that every sequence reads back exactly the tokens it wrote (copy-on-write
isolation); and a real KVCache + paged_decode checks forked sequences end to end.
"""

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings

import jpa
from jpa.kv import pages
from marks import tiered

# Compiled once per static shape; hypothesis examples reuse them (fixed-length id arrays).
NUM_IDS = 3
j_reserve = jax.jit(lambda s, ids, n: pages.reserve(s, ids, n, return_cow=True))
j_reserve_strict = jax.jit(lambda s, ids, n: pages.reserve(s, ids, n))
j_append = jax.jit(pages.append)
j_release = jax.jit(pages.release)
j_fork = jax.jit(pages.fork)
j_truncate = jax.jit(pages.truncate)
j_free = jax.jit(pages.num_free_pages)
j_needed = jax.jit(pages.pages_needed)


def _cdiv(a, b):
    return -(-a // b)


# ----------------------------------------------------------------------------- NumPy model


class Model:
    """Sequential allocator: what the vectorized one must equal, state for state."""

    def __init__(self, num_pages, max_seqs, pages_per_seq, page_size):
        self.P, self.B, self.pps, self.ps = num_pages, max_seqs, pages_per_seq, page_size
        self.stack = list(range(num_pages - 1, -1, -1))  # top = end
        self.ref = np.zeros(num_pages, np.int64)
        self.tables = np.zeros((max_seqs, pages_per_seq), np.int64)
        self.lens = np.zeros(max_seqs, np.int64)

    def npages(self, b):
        return _cdiv(int(self.lens[b]), self.ps)

    def _cow_set(self, targets):
        """Sequences that copy on write when `targets` (b -> new length) grow together."""
        partial = {b: int(self.tables[b, self.npages(b) - 1]) for b, t in targets.items()
                   if t > self.lens[b] and self.lens[b] % self.ps}
        cow = set()
        for b, p in partial.items():
            if self.ref[p] > 1:
                growers = sorted(c for c, q in partial.items() if q == p)
                if not (len(growers) == self.ref[p] and growers[0] == b):
                    cow.add(b)
        return cow

    def needed(self, targets):
        cow = self._cow_set(targets)
        return sum(max(0, _cdiv(t, self.ps) - self.npages(b)) for b, t in targets.items()
                   if t > self.lens[b]) + len(cow), cow

    def grow(self, targets, allow_cow=True):
        """targets: b -> new length (already validated). Returns (ok, {b: (src, dst)})."""
        n, cow = self.needed(targets)
        if n > len(self.stack) or (cow and not allow_cow):
            return False, {}
        copies = {}
        for b in sorted(targets):
            t, old = targets[b], self.npages(b)
            if t <= self.lens[b]:
                continue
            if b in cow:
                src, dst = int(self.tables[b, old - 1]), self.stack.pop()
                self.ref[src] -= 1
                self.ref[dst] = 1
                self.tables[b, old - 1] = dst
                copies[b] = (src, dst)
            for j in range(old, _cdiv(t, self.ps)):
                p = self.stack.pop()
                self.ref[p] = 1
                self.tables[b, j] = p
            self.lens[b] = t
        return True, copies

    def release(self, ids):
        freed = set()
        for b in set(ids):
            for j in range(self.npages(b)):
                p = int(self.tables[b, j])
                self.ref[p] -= 1
                if self.ref[p] == 0:
                    freed.add(p)
            self.tables[b] = 0
            self.lens[b] = 0
        self.stack.extend(sorted(freed))

    def truncate(self, ids, counts):
        """Sequence b keeps min(len, count) tokens (the smallest count of a repeated id)."""
        target = {}
        for b, n in zip(ids, counts):
            if 0 <= b < self.B:
                target[b] = min(target.get(b, int(self.lens[b])), n)
        freed = set()
        for b, n in target.items():
            for j in range(_cdiv(n, self.ps), self.npages(b)):
                p = int(self.tables[b, j])
                self.ref[p] -= 1
                if self.ref[p] == 0:
                    freed.add(p)
                self.tables[b, j] = 0
            self.lens[b] = n
        self.stack.extend(sorted(freed))

    def fork(self, pairs):
        tables, lens = self.tables.copy(), self.lens.copy()
        for s, d in pairs:
            self.tables[d] = tables[s]
            self.lens[d] = lens[s]
            self.ref[tables[s, :_cdiv(int(lens[s]), self.ps)]] += 1

    def slot(self, b, pos):
        return int(self.tables[b, pos // self.ps]) * self.ps + pos % self.ps


def assert_matches_model(state, m):
    nf = int(state.num_free)
    np.testing.assert_array_equal(np.asarray(state.free_pages)[:nf], m.stack)
    np.testing.assert_array_equal(state.refcounts, m.ref)
    np.testing.assert_array_equal(state.block_tables, m.tables)
    np.testing.assert_array_equal(state.seq_lens, m.lens)


def check_invariants(state):
    """Independent of the model: what any correct allocator state satisfies."""
    chex.assert_shape(state.free_pages, (state.num_pages,))
    chex.assert_shape(state.seq_lens, (state.max_seqs,))
    chex.assert_type([state.free_pages, state.num_free, state.refcounts, state.block_tables,
                      state.seq_lens], jnp.int32)
    P, ps = state.num_pages, state.page_size
    nf = int(state.num_free)
    free = np.asarray(state.free_pages)[:nf]
    ref = np.asarray(state.refcounts)
    tables, lens = np.asarray(state.block_tables), np.asarray(state.seq_lens)
    assert 0 <= nf <= P
    assert len(set(free.tolist())) == nf, "a page is in the free stack twice"
    assert np.all((free >= 0) & (free < P))
    assert np.all(ref[free] == 0), "a free page is referenced"
    assert np.all(ref >= 0)
    assert nf + int(np.sum(ref > 0)) == P, "free + referenced != total"
    counts = np.zeros(P, np.int64)
    for b in range(state.max_seqs):
        assert 0 <= lens[b] <= state.max_seq_len
        n = _cdiv(int(lens[b]), ps)
        own = tables[b, :n]
        assert len(set(own.tolist())) == n, f"sequence {b} holds a page twice"
        np.add.at(counts, own, 1)
        assert np.all(tables[b, n:] == 0), "table entries past a sequence's pages must be 0"
    counts += np.asarray(state.cached)  # the prefix cache holds one reference of a cached page
    np.testing.assert_array_equal(ref, counts, err_msg="refcounts != table entries (+1 if cached) per page")


def assert_same_state(a, b):
    chex.assert_trees_all_equal(a, b)
    assert a.page_size == b.page_size


# ----------------------------------------------------------------------------- hand-worked case


def test_hand_worked():
    s = pages.init(8, 4, 4, 2)  # pops hand out 0, 1, 2, ...
    s, ok = pages.reserve(s, [0, 1], [3, 1])
    assert bool(ok)
    np.testing.assert_array_equal(s.block_tables[:2], [[0, 1, 0, 0], [2, 0, 0, 0]])
    np.testing.assert_array_equal(s.refcounts, [1, 1, 1, 0, 0, 0, 0, 0])
    assert int(pages.num_free_pages(s)) == 5
    s, ok = pages.fork(s, [0], [2])
    assert bool(ok)
    np.testing.assert_array_equal(s.refcounts, [2, 2, 1, 0, 0, 0, 0, 0])
    # Seq 0 and 2 share partial page 1 (1 of 2 slots used); 2 appends alone -> copies into page 3.
    assert int(pages.pages_needed(s, [2], [4])) == 1
    s, slots, ok, cow = pages.append(s, jnp.array([False, False, True, False]))
    assert bool(ok)
    np.testing.assert_array_equal(slots, [-1, -1, 3 * 2 + 1, -1])
    np.testing.assert_array_equal(cow.src, [-1, -1, 1, -1])
    np.testing.assert_array_equal(cow.dst, [-1, -1, 3, -1])
    np.testing.assert_array_equal(s.block_tables[2], [0, 3, 0, 0])
    np.testing.assert_array_equal(s.refcounts, [2, 1, 1, 1, 0, 0, 0, 0])
    # Seq 0 appends: page 1 is its own now, no copy; seq 1 fills the second slot of page 2.
    s, slots, ok, cow = pages.append(s, jnp.array([True, True, False, False]))
    np.testing.assert_array_equal(slots, [1 * 2 + 1, 2 * 2 + 1, -1, -1])
    np.testing.assert_array_equal(cow.dst, [-1, -1, -1, -1])
    np.testing.assert_array_equal(pages.slot_mapping_for(s, [0, 2, -1], 1, [3, 2, 1], width=4),
                                  [[1, 2, 3, -1], [1, 6, -1, -1], [-1, -1, -1, -1]])
    s = pages.release(s, [0, 2])  # page 0 drops to 0 only when both have gone
    np.testing.assert_array_equal(s.refcounts, [0, 0, 1, 0, 0, 0, 0, 0])
    assert int(s.num_free) == 7
    np.testing.assert_array_equal(np.asarray(s.free_pages)[:7], [7, 6, 5, 4, 0, 1, 3])
    check_invariants(s)


def test_both_holders_append_one_keeps_the_page():
    s = pages.init(6, 3, 2, 4)
    s, _ = pages.reserve(s, 0, 2)
    s, _ = pages.fork(s, [0, 0], [1, 2])  # page 0 held three times, half full
    s, slots, ok, cow = pages.append(s, jnp.array([True, True, True]))
    assert bool(ok)
    # Seq 0 (lowest id) keeps page 0; 1 and 2 copy it: 2 pages, not 3, and none left orphaned.
    np.testing.assert_array_equal(cow.src, [-1, 0, 0])
    np.testing.assert_array_equal(cow.dst, [-1, 1, 2])
    np.testing.assert_array_equal(slots, [2, 6, 10])
    np.testing.assert_array_equal(s.refcounts, [1, 1, 1, 0, 0, 0])
    check_invariants(s)


def test_out_of_pages_is_all_or_nothing():
    s = pages.init(3, 3, 4, 2)
    s, ok = pages.reserve(s, [0, 1], [4, 1])  # uses all 3 pages
    assert bool(ok) and int(s.num_free) == 0
    before = jax.tree.map(np.asarray, s)
    # Seq 1 fits in its page, seq 0 crosses a boundary and cannot: neither advances.
    s2, slots, ok, cow = j_append(s, jnp.array([True, True, False]))
    assert not bool(ok)
    assert_same_state(s2, before)
    np.testing.assert_array_equal(slots, [-1, -1, -1])
    np.testing.assert_array_equal(cow.dst, [-1, -1, -1])
    s3, ok = j_reserve_strict(s, np.array([2, -1, -1], np.int32), np.array([1, 0, 0], np.int32))
    assert not bool(ok)
    assert_same_state(s3, before)
    # Seq 1 alone fits.
    s4, slots, ok, _ = j_append(s, jnp.array([False, True, False]))
    assert bool(ok) and int(slots[1]) == int(s.block_tables[1, 0]) * 2 + 1


def test_out_of_pages_with_copy_on_write_is_all_or_nothing():
    s = pages.init(3, 3, 4, 2)
    s, _ = pages.reserve(s, 0, 3)
    s, _ = pages.fork(s, 0, 1)
    s, _ = pages.reserve(s, 2, 2)  # pool empty; seqs 0 and 1 share a half-full page
    before = jax.tree.map(np.asarray, s)
    for active in ([False, True, False], [True, False, False]):  # each alone must copy: no page
        s2, slots, ok, cow = j_append(s, jnp.array(active))
        assert not bool(ok)
        assert_same_state(s2, before)
        np.testing.assert_array_equal(cow.src, [-1, -1, -1])
    s3, ok, cow = j_reserve(s, np.array([1, -1, -1], np.int32), np.array([4, 0, 0], np.int32))
    assert not bool(ok)
    assert_same_state(s3, before)
    # Both appending together: seq 0 keeps the page, seq 1 must copy -- still no page.
    s2, _, ok, _ = j_append(s, jnp.array([True, True, False]))
    assert not bool(ok)
    assert_same_state(s2, before)
    s = pages.release(s, 2)
    s2, slots, ok, cow = j_append(s, jnp.array([True, True, False]))
    assert bool(ok)
    np.testing.assert_array_equal(cow.src, [-1, int(s.block_tables[0, 1]), -1])
    check_invariants(s2)


# ----------------------------------------------------------------------------- property test


CONFIGS = [  # (num_pages, max_seqs, pages_per_seq, page_size): small pools run out often
    (8, 4, 4, 2),
    (7, 4, 3, 3),
]

id_st = st.integers(-1, 4)  # 4 is >= max_seqs: an invalid traced id
# Half the id lists are valid (distinct ids, -1 padding), half arbitrary (duplicates, id 4).
ids_st = st.one_of(
    st.lists(st.integers(0, 3), max_size=NUM_IDS, unique=True).map(
        lambda ids: ids + [-1] * (NUM_IDS - len(ids))),
    st.lists(id_st, min_size=NUM_IDS, max_size=NUM_IDS))
op_st = st.one_of(
    # relative=True: counts are growth over the current length (mostly valid, often run out);
    # relative=False: absolute lengths (often shrinks or over the limit: must fail cleanly).
    st.tuples(st.just("reserve"), ids_st,
              st.lists(st.integers(0, 13), min_size=NUM_IDS, max_size=NUM_IDS), st.booleans(),
              st.sampled_from([True, True, False])),
    st.tuples(st.just("append"), st.lists(st.booleans(), min_size=4, max_size=4)),
    st.tuples(st.just("append"), st.lists(st.booleans(), min_size=4, max_size=4)),
    st.tuples(st.just("release"), ids_st),
    # Speculative rollback: counts are how many tokens to take off (0..3).
    st.tuples(st.just("truncate"), ids_st, st.lists(st.integers(0, 3), min_size=NUM_IDS, max_size=NUM_IDS)),
    # to_empty=True: dst d >= 0 means the d-th empty sequence (forks that can succeed).
    st.tuples(st.just("fork"), st.lists(st.integers(0, 3), min_size=NUM_IDS, max_size=NUM_IDS),
              ids_st, st.booleans()),
)


class TokenCache:
    """A toy cache of token ids, one int per slot: who wrote what, and who can read it back."""

    def __init__(self, num_pages, page_size, max_seqs):
        self.ps = page_size
        self.data = np.full((num_pages, page_size), -1, np.int64)
        self.contents = [[] for _ in range(max_seqs)]
        self.next = 0

    def copy(self, cow):
        src, dst = np.asarray(cow.src), np.asarray(cow.dst)
        keep = dst >= 0
        self.data[dst[keep]] = self.data[src[keep]]  # gather then scatter, as copy_pages

    def write(self, b, slot):
        assert slot >= 0
        self.data.reshape(-1)[slot] = self.next
        self.contents[b].append(self.next)
        self.next += 1

    def check(self, state):
        tables, lens = np.asarray(state.block_tables), np.asarray(state.seq_lens)
        for b, want in enumerate(self.contents):
            assert lens[b] == len(want)
            pos = np.arange(lens[b])
            got = self.data[tables[b, pos // self.ps], pos % self.ps]
            np.testing.assert_array_equal(got, want, err_msg=f"sequence {b} reads another's tokens")


def run_ops(config, ops):
    P, B, pps, ps = config
    cap = pps * ps
    state = pages.init(*config)
    model, cache = Model(*config), TokenCache(P, ps, B)
    for op in ops:
        before = state
        kind = op[0]
        if kind == "reserve":
            _, ids, counts, allow_cow, relative = op
            if relative:
                counts = [int(model.lens[b]) + n // 2 if 0 <= b < B else n
                          for b, n in zip(ids, counts)]
            ids_a, counts_a = np.array(ids, np.int32), np.array(counts, np.int32)
            real = [(b, n) for b, n in zip(ids, counts) if b >= 0]
            valid = (all(b < B for b, _ in real) and len({b for b, _ in real}) == len(real)
                     and all(model.lens[b] <= n <= cap for b, n in real if b < B))
            targets = dict(real) if valid else {}
            if valid:
                need, _ = model.needed(targets)
                assert int(j_needed(state, ids_a, counts_a)) == need
            old_lens = model.lens.copy()
            want_ok, copies = model.grow(targets, allow_cow) if valid else (False, {})
            if allow_cow:
                state, ok, cow = j_reserve(state, ids_a, counts_a)
            else:
                state, ok = j_reserve_strict(state, ids_a, counts_a)
                cow = pages.CopyOnWrite(src=-jnp.ones(B, jnp.int32), dst=-jnp.ones(B, jnp.int32))
            assert bool(ok) == want_ok, (op, want_ok)
            np.testing.assert_array_equal(cow.src, [copies.get(b, (-1, -1))[0] for b in range(B)])
            np.testing.assert_array_equal(cow.dst, [copies.get(b, (-1, -1))[1] for b in range(B)])
            if copies:
                event("reserve copied on write")
            if want_ok:
                cache.copy(cow)
                start = np.array([old_lens[b] if b >= 0 else 0 for b in ids], np.int32)
                grow = np.array([n - old_lens[b] if b >= 0 else 0 for b, n in zip(ids, counts)],
                                np.int32)
                slots = np.asarray(pages.slot_mapping_for(state, ids_a, start, grow, width=cap))
                for r, b in enumerate(ids):
                    assert np.all(slots[r, grow[r]:] == -1)
                    for i in range(grow[r]):
                        assert slots[r, i] == model.slot(b, start[r] + i)
                        cache.write(b, int(slots[r, i]))
        elif kind == "append":
            active = np.array(op[1])
            valid = all(model.lens[b] < cap for b in range(B) if active[b])
            old_lens = model.lens.copy()
            targets = {b: int(model.lens[b]) + 1 for b in range(B) if active[b]}
            if valid:
                assert int(j_needed(state, np.arange(B, dtype=np.int32),
                                    np.minimum(model.lens + active, cap).astype(np.int32))) \
                    == model.needed(targets)[0]
            want_ok, copies = model.grow(targets) if valid else (False, {})
            state, slots, ok, cow = j_append(state, jnp.asarray(active))
            assert bool(ok) == want_ok, (op, want_ok)
            np.testing.assert_array_equal(cow.src, [copies.get(b, (-1, -1))[0] for b in range(B)])
            np.testing.assert_array_equal(cow.dst, [copies.get(b, (-1, -1))[1] for b in range(B)])
            if copies:
                event("append copied on write")
            slots = np.asarray(slots)
            cache.copy(cow)
            for b in range(B):
                if want_ok and active[b]:
                    # The new token sits in the sequence's own page at offset (seq_len - 1) % ps.
                    pos = int(old_lens[b])
                    assert slots[b] // ps == state.block_tables[b, pos // ps]
                    assert slots[b] % ps == (int(state.seq_lens[b]) - 1) % ps
                    assert slots[b] == model.slot(b, pos)
                    cache.write(b, int(slots[b]))
                else:
                    assert slots[b] == -1
        elif kind == "release":
            ids = op[1]
            model.release([b for b in ids if 0 <= b < B])  # out-of-range traced ids are ignored
            for b in ids:
                if 0 <= b < B:
                    cache.contents[b] = []
            state, want_ok = j_release(state, np.array(ids, np.int32)), True
        elif kind == "truncate":
            _, ids, cut = op
            counts = [max(0, int(model.lens[b]) - c) if 0 <= b < B else 0 for b, c in zip(ids, cut)]
            model.truncate(ids, counts)
            for b in range(B):
                del cache.contents[b][int(model.lens[b]):]
            state, want_ok = j_truncate(state, np.array(ids, np.int32), np.array(counts, np.int32)), True
            if any(c for b, c in zip(ids, cut) if 0 <= b < B):
                event("truncate shrank")
        else:
            _, src, dst, to_empty = op
            empty = [b for b in range(B) if model.lens[b] == 0]
            held = [b for b in range(B) if model.lens[b] > 0]
            if to_empty and empty:
                dst = [empty[d % len(empty)] if 0 <= d < B else d for d in dst]
            if to_empty and held:
                src = [held[s % len(held)] for s in src]
            pairs = [(s, d) for s, d in zip(src, dst) if d >= 0]
            want_ok = (all(d < B for _, d in pairs) and len({d for _, d in pairs}) == len(pairs)
                       and all(model.lens[d] == 0 for _, d in pairs))
            if want_ok:
                model.fork(pairs)
                old = [list(c) for c in cache.contents]
                for s, d in pairs:
                    cache.contents[d] = list(old[s])
            state, ok = j_fork(state, np.array(src, np.int32), np.array(dst, np.int32))
            assert bool(ok) == want_ok, (op, want_ok)
        event(f"{kind} ok={want_ok}")
        if not want_ok:
            assert_same_state(state, before)
        assert int(j_free(state)) == len(model.stack)
        assert_matches_model(state, model)
        check_invariants(state)
        cache.check(state)
    state = j_release(state, np.arange(B, dtype=np.int32)[:NUM_IDS])
    state = j_release(state, np.arange(B, dtype=np.int32)[-NUM_IDS:])
    assert int(state.num_free) == P
    np.testing.assert_array_equal(state.refcounts, np.zeros(P))
    np.testing.assert_array_equal(np.sort(np.asarray(state.free_pages)), np.arange(P))
    check_invariants(state)


@pytest.mark.parametrize("config", tiered(CONFIGS, soak=(1,)))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_st, min_size=4, max_size=24))
@example(ops=[  # always run: copy on write in append and reserve, failed forks, running out
    ("reserve", [0, 1, -1], [5, 1, 0], True, False), ("fork", [0, 0, 0], [2, 3, -1], False),
    ("append", [True, False, True, False]), ("append", [True, True, True, True]),
    ("fork", [1, -1, -1], [0, -1, -1], False), ("reserve", [3, -1, -1], [9, 0, 0], True, False),
    ("append", [True, True, True, True]), ("release", [0, 3, -1]),
    ("fork", [2, 2, -1], [0, 3, -1], False), ("reserve", [0, -1, -1], [2, 0, 0], True, True),
    ("reserve", [3, -1, -1], [2, 0, 0], False, True), ("append", [True] * 4)])
def test_random_operation_sequences(config, ops):
    run_ops(config, ops)


def test_random_sequences_hit_every_outcome():
    """The property test is only as good as what it reaches: make sure a plain random run of the
    same generator reaches out-of-pages failures, copies on write and full releases."""
    rng = np.random.default_rng(0)
    config = CONFIGS[0]
    P, B, pps, ps = config
    state, m = pages.init(*config), Model(*config)
    seen = {"oom": 0, "cow": 0, "ok": 0}
    for _ in range(120):
        r = rng.integers(4)
        if r == 0:
            b = int(rng.integers(B))
            n = int(rng.integers(m.lens[b], pps * ps + 1))
            state, ok, cow = j_reserve(state, np.array([b, -1, -1], np.int32),
                                       np.array([n, 0, 0], np.int32))
        elif r == 1:
            state, _, ok, cow = j_append(state, jnp.asarray(rng.random(B) < 0.7)
                                         & (state.seq_lens < pps * ps))
        elif r == 2:
            state, ok = j_fork(state, np.array([int(rng.integers(B)), -1, -1], np.int32),
                               np.array([int(rng.integers(B)), -1, -1], np.int32))
            cow = None
        else:
            state, ok, cow = j_release(state, np.array([int(rng.integers(B)), -1, -1], np.int32)), True, None
        check_invariants(state)
        seen["ok"] += bool(ok)
        seen["oom"] += (not bool(ok)) and r in (0, 1)
        seen["cow"] += cow is not None and bool(np.any(np.asarray(cow.dst) >= 0))
    assert seen["oom"] > 0 and seen["cow"] > 0 and seen["ok"] > 0, seen


# ----------------------------------------------------------------------------- invalid traced values


def test_invalid_traced_arguments_fail_without_change():
    s = pages.init(8, 3, 3, 2)
    s, _ = pages.reserve(s, [0, 1], [3, 2])
    before = jax.tree.map(np.asarray, s)
    i32 = lambda *v: np.array(v, np.int32)
    cases = [
        (i32(0, 0, -1), i32(4, 5, 0)),  # duplicate id
        (i32(3, -1, -1), i32(1, 0, 0)),  # id >= max_seqs
        (i32(-2, -1, -1), i32(1, 0, 0)),  # id < -1
        (i32(0, -1, -1), i32(2, 0, 0)),  # shrink (seq 0 holds 3)
        (i32(2, -1, -1), i32(7, 0, 0)),  # over pages_per_seq * page_size = 6
        (i32(2, -1, -1), i32(-1, 0, 0)),  # negative count
    ]
    for ids, n in cases:
        s2, ok = j_reserve_strict(s, ids, n)
        assert not bool(ok), (ids, n)
        assert_same_state(s2, before)
    # Same length is a no-op that succeeds.
    s2, ok = j_reserve_strict(s, i32(0, -1, -1), i32(3, 0, 0))
    assert bool(ok)
    assert_same_state(s2, before)
    # Growing into a shared partial page without return_cow fails; with it, it copies.
    sf, ok = pages.fork(s, 0, 2)
    s3, ok = j_reserve_strict(sf, i32(2, -1, -1), i32(4, 0, 0))
    assert not bool(ok)
    assert_same_state(s3, sf)
    s3, ok, cow = j_reserve(sf, i32(2, -1, -1), i32(4, 0, 0))
    assert bool(ok) and int(cow.src[2]) == int(s.block_tables[0, 1])
    check_invariants(s3)
    # Fork into a non-empty sequence, or with a traced bad src / dst, fails.
    for src, dst in [(i32(0, -1, -1), i32(1, -1, -1)), (i32(-1, -1, -1), i32(2, -1, -1)),
                     (i32(0, 0, -1), i32(2, 2, -1)), (i32(0, -1, -1), i32(5, -1, -1))]:
        s2, ok = j_fork(s, src, dst)
        assert not bool(ok), (src, dst)
        assert_same_state(s2, before)
    # Append past pages_per_seq * page_size fails.
    full, _ = pages.reserve(s, 2, 6)
    s2, slots, ok, _ = j_append(full, jnp.array([False, False, True]))
    assert not bool(ok) and np.all(np.asarray(slots) == -1)
    assert_same_state(s2, full)
    # Release ignores traced out-of-range ids.
    s2 = j_release(s, i32(7, -3, 1))
    np.testing.assert_array_equal(s2.seq_lens, [3, 0, 0])
    check_invariants(s2)


def test_slot_mapping_for_only_reserved_tokens():
    s = pages.init(8, 2, 4, 2)
    s, _ = pages.reserve(s, [0], [3])
    got = jax.jit(lambda s, i, a, n: pages.slot_mapping_for(s, i, a, n, width=4))(
        s, np.array([0, 1, -1], np.int32), np.array([0, 0, 0], np.int32),
        np.array([4, 2, 2], np.int32))
    np.testing.assert_array_equal(got, [[0, 1, 2, -1], [-1] * 4, [-1] * 4])


# ----------------------------------------------------------------------------- host-side validation


@pytest.mark.parametrize("args, match", [
    ((0, 1, 1, 1), "num_pages"), ((4, 0, 1, 1), "max_seqs"), ((4, 1, -1, 1), "pages_per_seq"),
    ((4, 1, 1, 0), "page_size"), ((4.0, 1, 1, 1), "num_pages"), ((4, True, 1, 1), "max_seqs"),
    ((2**30, 1, 1, 4), "int32"),
])
def test_init_rejects_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        pages.init(*args)


def _state():
    s = pages.init(8, 3, 2, 4)
    s, _ = pages.reserve(s, 0, 5)
    return s


@pytest.mark.parametrize("call, match", [
    (lambda s: pages.reserve(s, 3, 1), r"seq_ids entries must be sequence ids in \[0, max_seqs = 3\)"),
    (lambda s: pages.reserve(s, [-2], 1), "seq_ids entries"),
    (lambda s: pages.reserve(s, [1, 1], 1), "must not repeat"),
    (lambda s: pages.reserve(s, [[1]], 1), "1-D"),
    (lambda s: pages.reserve(s, np.array([1.0]), 1), "integer dtype"),
    (lambda s: pages.reserve(s, True, 1), "sequence ids"),
    (lambda s: pages.reserve(s, [1.0], 1), "sequence ids"),
    (lambda s: pages.reserve(s, 1, -1), r"num_tokens must be in \[0, pages_per_seq \* page_size = 8\]"),
    (lambda s: pages.reserve(s, 1, 9), "num_tokens must be in"),
    (lambda s: pages.reserve(s, [1, 2], [1, 2, 3]), r"i32\[2\]"),
    (lambda s: pages.reserve(s, 1, 1.5), "num_tokens"),
    (lambda s: pages.reserve("state", 1, 1), "PageState"),
    (lambda s: pages.append(s, np.ones(2, bool)), r"active must be bool\[max_seqs = 3\]"),
    (lambda s: pages.append(s, np.ones(3, np.int32)), "active must be bool"),
    (lambda s: pages.append(s, [True, True, True]), "active must be bool"),
    (lambda s: pages.release(s, [0, 3]), "seq_ids entries"),
    (lambda s: pages.release(s, -5), "seq_ids entries"),
    (lambda s: pages.fork(s, [0, 1], [2]), "same length"),
    (lambda s: pages.fork(s, [-1], [2]), "src_ids must be a sequence id"),
    (lambda s: pages.fork(s, [0, 0], [2, 2]), "dst_ids must not repeat"),
    (lambda s: pages.fork(s, [3], [2]), "src_ids entries"),
    (lambda s: pages.fork(s, [0], [4]), "dst_ids entries"),
    (lambda s: pages.pages_needed(s, [0], [9]), "num_tokens must be in"),
    (lambda s: pages.slot_mapping_for(s, [0], 0, [9]), "num_tokens must be in"),
    (lambda s: pages.slot_mapping_for(s, [0], -1, [2]), "start must be in"),
    (lambda s: pages.slot_mapping_for(s, [0], 0, [3], width=2), "num_tokens must be <= width"),
    (lambda s: pages.slot_mapping_for(s, [0], 0, [3], width=-1), "width must be an int"),
    (lambda s: jax.jit(lambda s, n: pages.slot_mapping_for(s, [0], 0, n))(s, np.array([1], np.int32)),
     "width .* is required"),
])
def test_invalid_concrete_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call(_state())


# ----------------------------------------------------------------------------- jit properties


def test_donated_state_is_deleted_and_one_compile_serves_all():
    traces = []

    def counted_append(s, active):
        traces.append(1)  # runs once per trace, i.e. per compilation
        return pages.append(s, active)

    step = jax.jit(counted_append, donate_argnums=0)
    s = pages.init(16, 4, 4, 4)
    for i in range(6):
        old = s
        s, slots, ok, _ = step(s, jnp.array([True, i % 2 == 0, False, True]))
        assert bool(ok)
        assert all(x.is_deleted() for x in jax.tree.leaves(old))
    np.testing.assert_array_equal(s.seq_lens, [6, 3, 0, 6])
    check_invariants(s)
    assert len(traces) == 1  # lengths and tables are data, not shapes


def test_donated_append_updates_in_place():
    """No copy of the pool-sized arrays: scratch memory is a few max_seqs-sized vectors."""
    s = pages.init(65536, 64, 16, 16)
    compiled = jax.jit(pages.append, donate_argnums=0).lower(s, jnp.ones(64, bool)).compile()
    mem = compiled.memory_analysis()
    assert mem.temp_size_in_bytes < 65536 * 4 // 4, mem  # a quarter of one i32[num_pages] array
    assert mem.alias_size_in_bytes >= sum(x.nbytes for x in jax.tree.leaves(s)) - 8, mem


# ----------------------------------------------------------------------------- end to end with a real cache


def _dense_attention(q, ks, vs, q_per_kv):
    """q [N, H]; ks, vs [T, K, H] -> [N, H] in float64."""
    k = np.repeat(ks, q_per_kv, axis=1).astype(np.float64)  # [T, N, H]
    v = np.repeat(vs, q_per_kv, axis=1).astype(np.float64)
    logits = np.einsum("NH,TNH->NT", q, k) * q.shape[-1] ** -0.5
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("NT,TNH->NH", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("prompt_len", [6, 8])  # fork mid-page (copy on write) and at a page boundary
def test_fork_shares_then_diverges_through_paged_decode(prompt_len):
    K, G, H, ps = 2, 2, 8, 4
    cfg = jpa.CacheConfig(num_layers=1, num_kv_heads=K, head_dim=H, num_pages=10, page_size=ps)
    cache, s = jpa.KVCache.create(cfg), pages.init(10, 3, 4, ps)
    rng = np.random.default_rng(1)
    kv = lambda n: (rng.standard_normal((n, K, H)).astype(np.float32),
                    rng.standard_normal((n, K, H)).astype(np.float32))
    s, ok = pages.reserve(s, 0, prompt_len)
    k0, v0 = kv(prompt_len)
    slots = pages.slot_mapping_for(s, [0], 0, prompt_len)  # [1, prompt_len]
    cache = cache.write(0, jnp.asarray(k0), jnp.asarray(v0), slots.reshape(-1))
    s, ok = pages.fork(s, [0, 0], [1, 2])
    assert bool(ok)
    q = jnp.asarray(rng.standard_normal((3, K * G, H)).astype(np.float32))
    q = jnp.broadcast_to(q[:1], q.shape)  # the same query for all three

    def decode():
        return np.asarray(jpa.paged_decode(q, cache.k[0], cache.v[0], s.block_tables, s.seq_lens,
                                           impl="xla"))

    out = decode()
    np.testing.assert_array_equal(out[1], out[0])
    np.testing.assert_array_equal(out[2], out[0])
    np.testing.assert_allclose(out[0], _dense_attention(np.asarray(q[0]), k0, v0, G), atol=1e-5)
    hist = {b: (list(k0), list(v0)) for b in range(3)}
    pages_of = lambda b: set(np.asarray(s.block_tables[b, :-(-int(s.seq_lens[b]) // ps)]).tolist())
    step = jax.jit(pages.append, donate_argnums=0)
    for active in ([False, True, False], [True, True, True], [True, False, True], [True, True, True]):
        s, slot, ok, cow = step(s, jnp.array(active))
        assert bool(ok)
        cache = jpa.copy_pages(cache, cow.src, cow.dst)  # before the new K/V, as vLLM does
        kn, vn = kv(3)
        cache = cache.write(0, jnp.asarray(kn), jnp.asarray(vn), slot)
        for b in range(3):
            if active[b]:
                hist[b][0].append(kn[b])
                hist[b][1].append(vn[b])
        out = decode()
        for b in range(3):
            want = _dense_attention(np.asarray(q[b]), np.stack(hist[b][0]), np.stack(hist[b][1]), G)
            np.testing.assert_allclose(out[b], want, atol=1e-5, err_msg=f"seq {b} after {active}")
        # A page still shared holds the same tokens for every holder, filled to the same level.
        for a in range(3):
            for b in range(a + 1, 3):
                for p in pages_of(a) & pages_of(b):
                    j = list(np.asarray(s.block_tables[a])).index(p)
                    assert int(s.block_tables[b, j]) == p
                    end_a = min((j + 1) * ps, int(s.seq_lens[a]))
                    assert end_a == min((j + 1) * ps, int(s.seq_lens[b]))
                    np.testing.assert_array_equal(np.stack(hist[a][0][j * ps:end_a]),
                                                  np.stack(hist[b][0][j * ps:end_a]))
        check_invariants(s)
    assert not np.allclose(out[0], out[1]) and not np.allclose(out[1], out[2])


# ----------------------------------------------------------------------------- prefix cache


def test_cached_pages_outlive_release_until_evicted():
    rng = np.random.default_rng()
    ps = int(rng.integers(2, 6))
    s = pages.init(16, 3, 6, ps)
    n = int(rng.integers(2 * ps, 4 * ps))  # 2 or 3 full pages, maybe a partial one
    s, ok = pages.reserve(s, [1], [n])
    assert ok
    full = n // ps
    s = pages.cache(s, [1], [6])  # capped at the full pages: a partial page is never cached
    check_invariants(s)
    held = np.asarray(s.block_tables)[1, :full]
    assert np.asarray(s.cached).sum() == full and np.asarray(s.cached)[held].all()
    s = pages.release(s, [1])
    check_invariants(s)
    assert int(s.num_free) == 16 - full, "cached-idle pages are not free"
    np.testing.assert_array_equal(np.asarray(s.refcounts)[held], 1)
    s = pages.uncache(s, [int(held[0]), -1])
    check_invariants(s)
    assert int(s.num_free) == 16 - full + 1
    s = pages.uncache(s, held.tolist())  # evicting twice is harmless
    check_invariants(s)
    assert int(s.num_free) == 16 and not np.asarray(s.cached).any()


def test_share_maps_cached_pages_and_grows_into_a_fresh_page():
    rng = np.random.default_rng()
    ps = 4
    s = pages.init(12, 3, 5, ps)
    s, _ = pages.reserve(s, [0], [9])            # 2 full pages + 1 token
    s = pages.cache(s, [0], [2])
    table = np.zeros((1, 5), np.int32)
    table[0, :2] = np.asarray(s.block_tables)[0, :2]
    s, ok = pages.share(s, [2], table, [8])
    assert ok
    check_invariants(s)
    np.testing.assert_array_equal(np.asarray(s.refcounts)[table[0, :2]], 3)  # seq 0, seq 2, the cache
    free = int(s.num_free)
    grow = int(rng.integers(1, 2 * ps))
    s, ok, cow = pages.reserve(s, [2], [8 + grow], return_cow=True)
    assert ok and (np.asarray(cow.src) == -1).all(), "a shared page is full: no copy on write"
    assert int(s.num_free) == free - pages.pages_for_tokens(grow, ps)
    s = pages.release(s, [0, 2])
    check_invariants(s)
    assert int(s.num_free) == 12 - 2
    s = pages.uncache(s, table[0, :2].tolist())
    check_invariants(s)
    assert int(s.num_free) == 12


@pytest.mark.parametrize("why", ["not cached", "not empty", "partial page", "repeated id"])
def test_share_refuses_and_leaves_the_state(why):
    s = pages.init(8, 3, 4, 2)
    s, _ = pages.reserve(s, [0], [4])
    s = pages.cache(s, [0], [1])
    table = np.zeros((2, 4), np.int32)
    table[:, 0] = np.asarray(s.block_tables)[0, 0]
    ids, n = [1, -1], [2, 0]
    if why == "not cached":
        table[0, 0] = np.asarray(s.block_tables)[0, 1]
    elif why == "not empty":
        ids = [0, -1]
    elif why == "partial page":
        n = [1, 0]
    else:
        ids, n = [1, 1], [2, 2]
    if why == "repeated id":
        with pytest.raises(ValueError):
            pages.share(s, ids, table, n)
        return
    out, ok = pages.share(s, ids, table, n)
    assert not ok
    assert_same_state(out, s)
