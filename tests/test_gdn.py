"""jpa.ops.gdn (Gated DeltaNet) against a NumPy float64 reference of the recurrence, on fresh random inputs:
the chunked ragged form equals the recurrence token by token, a sequence split into pieces anywhere equals
one piece (state carried), a fresh entry starts from zero, the causal conv with its state, the norms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpa.ops import gdn

RTOL, ATOL = 2e-5, 2e-5


def np_gdn(q, k, v, g, beta, s):
    """The gated delta rule token by token in float64 (transformers' torch_recurrent_gated_delta_rule, its state
    [h, dk, dv]); s and the returned state in jpa's layout [h, dv, dk]."""
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s))
    s = np.swapaxes(s, -1, -2)
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        s = s * np.exp(g[t])[:, None, None]
        kv = np.einsum("hkv,hk->hv", s, k[t])
        s = s + k[t][:, :, None] * ((v[t] - kv) * beta[t][:, None])[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, np.swapaxes(s, -1, -2)


def np_conv(x, w, state):
    """silu(causal depthwise conv) of one sequence x [T, C] after `state` [C, W-1] -> (y, new state)."""
    width = w.shape[1]
    full = np.concatenate([np.asarray(state, np.float64).T, np.asarray(x, np.float64)])  # [W-1+T, C]
    y = np.array([(full[t:t + width] * np.asarray(w, np.float64).T).sum(0) for t in range(x.shape[0])])
    return y / (1 + np.exp(-y)), full[-(width - 1):].T


def inputs(rng, t, heads=3, dk=8, dv=6):
    q = gdn.l2norm(rng.standard_normal((t, heads, dk))) * dk ** -0.5
    k = gdn.l2norm(rng.standard_normal((t, heads, dk)))
    v = rng.standard_normal((t, heads, dv))
    g = -np.exp(rng.standard_normal((t, heads)) - 1.0)  # decays in (0, 1), some near 1, some small
    beta = 1 / (1 + np.exp(-rng.standard_normal((t, heads))))
    return [np.asarray(a, np.float32) for a in (q, k, v, g, beta)]


def ragged(lens, budget):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    assert cu[-1] <= budget
    return cu


@pytest.mark.parametrize("lens,budget,num_seqs", [
    ((130, 1, 64, 0, 65, 3), 272, 6),   # several chunks, a decode row, exactly one chunk, an empty entry, 64 + 1
    ((7, 200), 210, 1),                  # the second entry past num_seqs: untouched, its rows padding
])
def test_chunked_ragged_equals_the_recurrence(lens, budget, num_seqs):
    rng = np.random.default_rng()
    cu = ragged(lens, budget)
    q, k, v, g, beta = inputs(rng, budget)
    states = rng.standard_normal((len(lens), 3, 6, 8)).astype(np.float32)  # [B, H, Dv, Dk]
    out, finals = jax.jit(gdn.gdn_ragged)(q, k, v, g, beta, states, cu, num_seqs)
    out, finals = np.asarray(out), np.asarray(finals)
    for b, n in enumerate(lens):
        rows = slice(cu[b], cu[b + 1])
        if b >= num_seqs or n == 0:
            np.testing.assert_array_equal(finals[b], states[b])
            continue
        want, want_s = np_gdn(q[rows], k[rows], v[rows], g[rows], beta[rows], states[b])
        np.testing.assert_allclose(out[rows], want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(finals[b], want_s, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(out[cu[num_seqs]:], 0.0)  # padding rows


def test_recurrent_and_step_forms_equal_the_reference():
    rng = np.random.default_rng()
    q, k, v, g, beta = inputs(rng, 20)
    s0 = rng.standard_normal((3, 6, 8)).astype(np.float32)
    out, s = jax.jit(gdn.gdn_recurrent)(q, k, v, g, beta, s0)
    want, want_s = np_gdn(q, k, v, g, beta, s0)
    np.testing.assert_allclose(np.asarray(out), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=RTOL, atol=ATOL)
    # gdn_step: a batch of rows, each its own sequence, one token
    states = rng.standard_normal((5, 3, 6, 8)).astype(np.float32)
    o, new = gdn.gdn_step(q[:5], k[:5], v[:5], g[:5], beta[:5], states)
    for b in range(5):
        want, want_s = np_gdn(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], states[b])
        np.testing.assert_allclose(np.asarray(o[b]), want[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(new[b]), want_s, rtol=RTOL, atol=ATOL)


def test_a_sequence_split_anywhere_equals_one_piece():
    rng = np.random.default_rng()
    total = 150
    cuts = np.sort(rng.choice(np.arange(1, total), size=3, replace=False))
    pieces = np.diff(np.concatenate([[0], cuts, [total]]))
    q, k, v, g, beta = inputs(rng, total)
    zero = np.zeros((1, 3, 6, 8), np.float32)
    run = jax.jit(gdn.gdn_ragged)
    whole, s_whole = run(q, k, v, g, beta, zero, np.array([0, total], np.int32), 1)
    state, outs, at = zero, [], 0
    for n in pieces:   # each piece in a call of its own, the rest of the token budget padding
        rows = np.clip(np.arange(at, at + total), 0, total - 1)
        o, state = run(q[rows], k[rows], v[rows], g[rows], beta[rows], state, np.array([0, n], np.int32), 1)
        outs.append(np.asarray(o)[:n])
        at += n
    np.testing.assert_allclose(np.concatenate(outs), np.asarray(whole), rtol=RTOL, atol=ATOL,
                               err_msg=f"pieces {pieces}")
    np.testing.assert_allclose(np.asarray(state), np.asarray(s_whole), rtol=RTOL, atol=ATOL)


def test_slots_reset_fresh_entries_and_leave_padding_untouched():
    rng = np.random.default_rng()
    states = rng.standard_normal((4, 2, 3)).astype(np.float32)
    slots = np.array([2, -1, 0, 3], np.int32)
    fresh = np.array([False, False, True, False])
    got = np.asarray(gdn.read_slots(states, slots, fresh))
    np.testing.assert_array_equal(got[0], states[2])
    np.testing.assert_array_equal(got[1], 0.0)   # padding entry
    np.testing.assert_array_equal(got[2], 0.0)   # position 0: a zero state, whatever the slot held
    np.testing.assert_array_equal(got[3], states[3])
    new = rng.standard_normal((4, 2, 3)).astype(np.float32)
    write = np.array([True, True, True, False])
    out = np.asarray(gdn.write_slots(states, slots, new, write))
    np.testing.assert_array_equal(out[2], new[0])
    np.testing.assert_array_equal(out[0], new[2])
    np.testing.assert_array_equal(out[1], states[1])  # no entry's slot
    np.testing.assert_array_equal(out[3], states[3])  # an entry that does not write (no rows)
    # by layer: states [layers, slots, ...], one layer's slots read and written, the other layers untouched
    stacked = np.stack([states, states + 1])
    np.testing.assert_array_equal(np.asarray(gdn.read_slots(stacked, slots, fresh, layer=1)),
                                  np.where((~fresh & (slots >= 0))[:, None, None], stacked[1][np.clip(slots, 0, 3)], 0))
    out2 = np.asarray(gdn.write_slots(stacked, slots, new, write, layer=1))
    np.testing.assert_array_equal(out2[1], np.asarray(gdn.write_slots(states + 1, slots, new, write)))
    np.testing.assert_array_equal(out2[0], states)


def test_conv_ragged_and_step_equal_the_reference():
    rng = np.random.default_rng()
    lens, width, chans = (5, 1, 0, 2, 9), 4, 7
    cu = ragged(lens, 20)
    x = rng.standard_normal((20, chans)).astype(np.float32)
    w = rng.standard_normal((chans, width)).astype(np.float32)
    states = rng.standard_normal((len(lens), chans, width - 1)).astype(np.float32)
    y, new = jax.jit(gdn.conv_ragged)(x, w, states, cu, len(lens))
    for b, n in enumerate(lens):
        rows = slice(cu[b], cu[b + 1])
        want, want_s = np_conv(x[rows], w, states[b])
        if n:
            np.testing.assert_allclose(np.asarray(y[rows]), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(new[b]), want_s if n else states[b], rtol=RTOL, atol=ATOL)
    y1, s1 = gdn.conv_step(x[:5], w, states)
    for b in range(5):
        want, want_s = np_conv(x[b:b + 1], w, states[b])
        np.testing.assert_allclose(np.asarray(y1[b]), want[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(s1[b]), want_s, rtol=RTOL, atol=ATOL)


def test_norms_equal_numpy():
    rng = np.random.default_rng()
    x, z = rng.standard_normal((2, 5, 16))
    w = rng.standard_normal(16)
    xd = x.astype(np.float64)
    want = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6) * w * (z / (1 + np.exp(-z)))
    np.testing.assert_allclose(np.asarray(gdn.gated_rms_norm(jnp.asarray(x, jnp.float32), z.astype(np.float32),
                                                             w.astype(np.float32), 1e-6)), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gdn.l2norm(x.astype(np.float32))),
                               xd / np.sqrt((xd * xd).sum(-1, keepdims=True) + 1e-6), rtol=1e-5, atol=1e-6)
