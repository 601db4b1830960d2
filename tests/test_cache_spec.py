"""The cache a model declares (jpa.kv.spec): its groups, their bytes, and how the engine reads it."""

import numpy as np
import pytest

import jpa.models as models
from jpa.engine import EngineConfig, LLMEngine
from jpa.kv.cache import CacheConfig
from jpa.kv.spec import CacheGroup, CacheSpec, FullAttention, LatentAttention, RecurrentState, SlidingWindow


def _rng(request):
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_bytes_per_token_equals_the_pools_bytes_per_page(request, dtype):
    """A full-attention spec costs, per page of tokens, exactly what the stacked pool's CacheConfig allocates
    (8-bit caches: with their f32 scale per token and head)."""
    rng = _rng(request)
    for _ in range(5):
        layers, heads, head_dim, page = (int(rng.integers(1, 40)), int(rng.integers(1, 9)),
                                         int(rng.choice([16, 64, 80, 128])), int(rng.choice([8, 16, 32])))
        spec = CacheSpec.attention(layers, heads, head_dim)
        cc = CacheConfig(layers, heads, head_dim, 4, page, dtype)
        assert spec.bytes_per_token(dtype) * page == cc.bytes_per_page
        ctx = int(rng.integers(1, 5000))
        assert spec.bytes_per_sequence(ctx, dtype, page) == -(-ctx // page) * cc.bytes_per_page


def test_sliding_window_pages_freed_equal_the_pages_the_window_touches(request):
    """bytes_per_sequence(freed=True) keeps, per sliding layer, the most pages any window of `window` positions
    (ending at any token of the sequence) touches: counted here position by position."""
    rng = _rng(request)
    for _ in range(20):
        window, page, ctx = int(rng.integers(1, 300)), int(rng.choice([4, 16, 32])), int(rng.integers(1, 2000))
        spec = CacheSpec.attention(4, 2, 16, window=window, window_layers=(0, 2))
        most = max(len({t // page for t in range(max(0, end - window + 1), end + 1)}) for end in range(ctx))
        full_pages = -(-ctx // page)
        per_page_layer = page * 2 * 2 * 16 * 4   # float32 K and V of 2 heads x 16
        want = per_page_layer * (2 * full_pages + 2 * min(full_pages, most))
        # the bound is tight for a window ending mid-page: allow it to hold one page the count above did not need
        got = spec.bytes_per_sequence(ctx, "float32", page, freed=True)
        assert want <= got <= want + 2 * per_page_layer
        assert spec.bytes_per_sequence(ctx, "float32", page) == per_page_layer * 4 * full_pages


def test_gpt_declares_its_sliding_layers_as_a_group():
    """Gemma-2-style alternating windows: the model's spec has a full and a sliding group covering every layer."""
    c = models.ModelConfig(family="llama", vocab_size=64, d_model=32, num_layers=6, num_q_heads=4, num_kv_heads=2,
                           head_dim=8, ffn_dim=64, max_seq_len=256, sliding_window=48,
                           sliding_window_layers=(0, 2, 4))
    spec = models.gpt.cache_spec(c)
    groups = {g.name: g for g in spec.groups}
    assert groups["full"].layers == (1, 3, 5) and groups["sliding"].layers == (0, 2, 4)
    assert groups["sliding"].layout == SlidingWindow(2, 8, 48)
    assert spec.check_served() == (2, 8)
    assert "sliding window 48" in spec.describe("float32") and "0, 2, 4" in spec.describe()


def test_spec_validation_names_the_rule():
    with pytest.raises(ValueError, match="cover 0..num_layers-1 once"):
        CacheSpec((CacheGroup("a", (0, 1), FullAttention(1, 8)), CacheGroup("b", (1, 2), FullAttention(1, 8))))
    with pytest.raises(ValueError, match="names must be distinct"):
        CacheSpec((CacheGroup("a", (0,), FullAttention(1, 8)), CacheGroup("a", (1,), FullAttention(1, 8))))
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        SlidingWindow(2, 8, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        CacheGroup("a", (0,), "full")
    with pytest.raises(ValueError, match="shapes entries"):
        RecurrentState((("state", (4, -1), "float32"),))
    mixed = CacheSpec((CacheGroup("a", (0,), FullAttention(2, 8)), CacheGroup("b", (1,), FullAttention(4, 8))))
    with pytest.raises(ValueError, match="different head shapes"):
        mixed.check_served()


def test_recurrent_and_latent_bytes():
    state = RecurrentState((("ssm", (4, 16, 16), "float32"), ("conv", (3, 96), "bfloat16")))
    spec = CacheSpec((CacheGroup("linear", (0, 1, 2), state), CacheGroup("mla", (3,), LatentAttention(576))))
    per_state = 4 * 16 * 16 * 4 + 3 * 96 * 2
    assert spec.bytes_per_token("bfloat16") == 576 * 2
    ctx = 1000
    assert spec.bytes_per_sequence(ctx, "bfloat16", 16) == 3 * per_state + -(-ctx // 16) * 16 * 576 * 2


class _Declares(models.GPTForEngine):
    """tiny-llama whose declared cache is whatever the test sets (the engine must read the declaration)."""
    declared = None

    def cache_spec(self):
        return self.declared


def _tiny(declared):
    gpt, tok = models.load("tiny-llama")
    m = _Declares(gpt)
    m.declared = declared
    return m, tok


def test_engine_refuses_a_group_it_cannot_allocate_naming_it():
    c = models.PRESETS["tiny-llama"]
    m, tok = _tiny(CacheSpec((CacheGroup("attn", (0,), FullAttention(c.num_kv_heads, c.head_dim)),
                              CacheGroup("mla", (1,), LatentAttention(64)))))
    with pytest.raises(ValueError, match="'mla' keeps a latent"):
        LLMEngine(m, tok, EngineConfig(max_seqs=2, num_pages=8, page_size=16))
    m.declared = CacheSpec.attention(c.num_layers + 1, c.num_kv_heads, c.head_dim)
    with pytest.raises(ValueError, match="covers 3 layers"):
        LLMEngine(m, tok, EngineConfig(max_seqs=2, num_pages=8, page_size=16))


def test_engine_sizes_the_pool_from_the_declared_spec_and_reports_it():
    """The pool's head shape comes from the declaration (not the config), and the summary and start-up line
    report the groups with their bytes."""
    c = models.PRESETS["tiny-llama"]
    heads = 2 * c.num_kv_heads   # not the config's: the pool must follow the declaration (no step runs here)
    m, tok = _tiny(CacheSpec.attention(c.num_layers, heads, c.head_dim, window=40, window_layers=(1,)))
    mem = 3 * CacheConfig(c.num_layers, heads, c.head_dim, 1, 16, "float32").bytes_per_page
    engine = LLMEngine(m, tok, EngineConfig(max_seqs=2, kv_memory_bytes=mem, page_size=16))
    assert engine.cache_config.num_kv_heads == heads and engine.cache_config.num_pages == 3
    assert engine.cache_config.bytes_per_page == engine.cache_spec.bytes_per_token("float32") * 16
    s = engine.summary()["cache_spec"]
    assert "full: 1 layers (0)" in s and "sliding: 1 layers (1), sliding window 40" in s
    assert "MiB per sequence at max_model_len 48" in engine.cache_report()
