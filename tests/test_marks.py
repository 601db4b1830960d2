"""tests/marks.tiered: the cases it names carry the tier's mark, the others none; a name it cannot find is refused."""

import re

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


def test_files_that_share_engines_are_one_unit_of_work_and_the_others_their_own(tmp_path):
    """tests/conftest.py's scheduler hands a worker each file, or each group of files named by their module
    `pytestmark`'s xdist_group (the engine files that compile the same step programs)."""
    import pathlib

    from marks import file_group

    root = pathlib.Path(__file__).parents[1]
    groups = {}
    for path in sorted((root / "tests").glob("test_*.py")):
        rel = str(path.relative_to(root))
        groups.setdefault(file_group(root, rel), []).append(rel)
        marked = re.search(r"^\s*(@pytest\.mark\.xdist_group|pytestmark\b.*xdist_group)", path.read_text(), re.M)
        if marked:   # a group mark the scheduler would miss (on a test, or a pytestmark over several lines)
            assert file_group(root, rel) != rel, f"{rel}: put xdist_group in its one-line module pytestmark"
    assert {"tests/test_engine.py", "tests/test_chunked_prefill.py"} <= set(groups["engines"])
    assert "tests/test_dispatch.py" in groups["engines_b"] and "tests/test_server_toolcalls.py" in groups["tiny_server"]
    assert groups["tests/test_pages.py"] == ["tests/test_pages.py"]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text('pytestmark = [pytest.mark.bench, pytest.mark.xdist_group("g")]\n')
    (tmp_path / "tests" / "test_y.py").write_text('# pytestmark = pytest.mark.xdist_group("g")\n')
    assert file_group(tmp_path, "tests/test_x.py") == "g"
    assert file_group(tmp_path, "tests/test_y.py") == "tests/test_y.py"
