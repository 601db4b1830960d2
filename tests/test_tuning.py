"""The kernels' tuning tables (`jpa/pallas/{mosaic,triton}/tuning.py`): validated frozen knobs, the
defaults looked up by GPU generation and shape, and kernels that take their tiling as an argument."""

import dataclasses

import jax
import numpy as np
import pytest

from jpa.pallas.common import TuningRow, lookup_tuning
from jpa.pallas.mosaic import decode as mosaic_decode
from jpa.pallas.mosaic import tuning as mosaic_tuning
from jpa.pallas.spec import DecodeSpec
from jpa.pallas.triton import decode as triton_decode
from jpa.pallas.triton import ragged as triton_ragged
from jpa.pallas.triton import tuning as triton_tuning
from jpa.testing.kernel_cases import Case, make_inputs, np_reference

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.mark.parametrize("cls,field,bad,words", [
    (mosaic_tuning.MosaicTuning, "block_tokens", 48, "power of two from 16 to 256"),
    (mosaic_tuning.MosaicTuning, "block_tokens", 512, "power of two from 16 to 256"),
    (mosaic_tuning.MosaicTuning, "max_slots", 1, "max_slots must be an int >= 2"),
    (mosaic_tuning.MosaicTuning, "smem_budget", 300 * 1024, "at most 232448"),
    (mosaic_tuning.MosaicTuning, "target_programs", 0, "target_programs must be a positive int"),
    (triton_tuning.DecodeTuning, "tile_elements", 1000, "power of two >= 256"),
    (triton_tuning.DecodeTuning, "partition_tokens", 0, "partition_tokens must be a positive int"),
    (triton_tuning.DecodeTuning, "full_grid_programs", -1, "full_grid_programs must be a positive int"),
    (triton_tuning.DecodeTuning, "no_split_max_tokens", 2.5, "no_split_max_tokens must be a positive int"),
    (triton_tuning.DecodeTuning, "num_warps", 3, "num_warps must be a power of two from 1 to 32"),
    (triton_tuning.DecodeTuning, "num_stages", 0, "num_stages must be a positive int"),
    (triton_tuning.RaggedTuning, "rows", 8, "rows must be a power of two >= 16"),
    (triton_tuning.RaggedTuning, "tile_elements", 128, "power of two >= 256"),
    (triton_tuning.RaggedTuning, "num_warps", 64, "num_warps must be a power of two from 1 to 32"),
])
def test_tuning_is_validated(cls, field, bad, words):
    with pytest.raises(ValueError, match=words) as e:
        cls(**{field: bad})
    assert repr(bad) in str(e.value)


def test_tuning_is_frozen_and_hashable():
    t = triton_tuning.DecodeTuning()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.num_warps = 8
    assert hash(t) == hash(triton_tuning.DecodeTuning()) and t != dataclasses.replace(t, num_warps=8)
    assert hash(mosaic_tuning.MosaicTuning()) == hash(mosaic_tuning.MosaicTuning())


def test_defaults_are_the_values_the_kernels_were_compiled_with():
    """Every generation's row holds the values the ptxas-checked runs in benchmarks/gpu_truth/ used."""
    for cc in (None, 8.0, 8.6, 8.9, 9.0, 10.0):
        for hd in (64, 128, 192, 256):
            assert mosaic_tuning.lookup(cc, hd) == mosaic_tuning.MosaicTuning(64, 4, 200 * 1024, 264)
            assert triton_tuning.decode_tuning(cc, hd) == triton_tuning.DecodeTuning(
                8192, 1024, 512, 8192, 4, 2)
            for cdt, tile in (("bfloat16", 4096), ("float16", 4096), ("float32", 2048)):
                assert triton_tuning.ragged_tuning(cc, hd, cdt) == triton_tuning.RaggedTuning(
                    64 if hd <= 128 else 16, tile, 4, 2)


def test_tables_say_what_was_measured():
    """Rows for a GPU generation cite a measurement; the fallback rows are marked unmeasured."""
    for table in (mosaic_tuning.TABLE, triton_tuning.DECODE_TABLE, triton_tuning.RAGGED_TABLE):
        assert table[-1].compute_capability is None and table[-1].measured == ""
        for row in table:
            if row.compute_capability is not None:
                assert "ptxas" in row.measured and "Speed: not measured" in row.measured, row
                assert "benchmarks/gpu_truth/" in row.measured, row


def test_lookup_takes_the_first_matching_row():
    a, b, c = (TuningRow("a", (9.0, 10.0), "sm90 narrow", "x", head_dims=(1, 128)),
               TuningRow("b", (9.0, 10.0), "sm90 f32", "x", compute_dtypes=("float32",)),
               TuningRow("c", None, "fallback"))
    table = (a, b, c)
    assert lookup_tuning(table, 9.0, 64).tuning == "sm90 narrow"
    assert lookup_tuning(table, 9.0, 256, "float32").tuning == "sm90 f32"
    assert lookup_tuning(table, 9.0, 256, "bfloat16").tuning == "fallback"
    assert lookup_tuning(table, None, 64).tuning == "fallback"  # interpret mode / unknown GPU
    assert lookup_tuning(table, 8.0, 64).tuning == "fallback"
    with pytest.raises(LookupError, match="fallback rows"):
        lookup_tuning((a,), 8.0, 64)


def test_the_tiling_is_an_argument():
    """A tuning passed in changes the plan (and the SMEM check), not the answer."""
    small = triton_tuning.DecodeTuning(tile_elements=1024, partition_tokens=64)
    assert triton_decode.plan(1, 2, 2, 64, 16, 16).block_k == 128
    p = triton_decode.plan(1, 2, 2, 64, 16, 16, tuning=small)
    assert (p.block_k, p.num_partitions) == (16, 4)
    assert triton_ragged.plan(64, 4, 2, 64, 16, 16, tuning=triton_tuning.RaggedTuning(rows=16)).rows == 16
    spec = DecodeSpec("bfloat16", "bfloat16", 8, 2, 256, 128, 4, False, False, False, False)
    tight = dataclasses.replace(mosaic_tuning.lookup(9.0, 256), smem_budget=96 * 1024)
    assert mosaic_decode.num_slots(256, 128, tuning=tight) == 0
    assert mosaic_decode.unsupported_reason(spec, 9.0) is None
    assert "96 KiB" in mosaic_decode.unsupported_reason(spec, 9.0, tuning=tight)

    case = Case((5, 40, 64), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, seed=3)
    args, opts = make_inputs(case)
    got = jax.block_until_ready(triton_decode.paged_decode(*args, **opts, interpret=True, tuning=small))
    np.testing.assert_allclose(np.asarray(got), np_reference(*args, **opts), atol=1e-5, rtol=1e-5)
