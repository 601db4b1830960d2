"""tests/marks.tiered: the cases it names carry the tier's mark, the others none; a name it cannot find is refused."""

import pytest

from marks import tiered


def _marks(v):
    return [m.name for m in getattr(v, "marks", ())]


def test_named_cases_carry_their_tier_and_the_rest_none():
    got = tiered(["a", "b", "c", "d"], bench=("b", 3), soak=(0,))
    assert [_marks(v) for v in got] == [["soak"], ["bench"], [], ["bench"]]
    assert [v.values[0] if _marks(v) else v for v in got] == ["a", "b", "c", "d"]
    pair = tiered([(1, "x"), (2, "y")], bench=(1,), unpack=True)
    assert pair[0] == (1, "x") and pair[1].values == (2, "y") and _marks(pair[1]) == ["bench"]


@pytest.mark.parametrize("kw", [dict(bench=("e",)), dict(bench=(4,)), dict(bench=(-1,)), dict(bench=(0,), soak=("a",))])
def test_a_case_not_in_the_list_or_named_twice_is_refused(kw):
    with pytest.raises(ValueError, match="not one of the 4 values .* or is named twice"):
        tiered(["a", "b", "c", "d"], **kw)
