"""Marks for single cases of a case list that several tests share (tests/conftest.py: soak implies bench)."""

import functools
import pathlib
import re

import pytest

_GROUP = re.compile(r"^pytestmark = .*pytest\.mark\.xdist_group\(\"(\w+)\"\)", re.M)


@functools.cache
def file_group(root: pathlib.Path, path: str) -> str:
    """The unit of work `./run test` hands a worker the tests of test file `path` in (tests/conftest.py's
    scheduler): the `xdist_group("NAME")` of the file's one-line module `pytestmark`, else the file itself."""
    m = _GROUP.search((root / path).read_text(encoding="utf-8"))
    return m.group(1) if m else path


def tiered(values, *, bench=(), soak=(), unpack=False):
    """`values`, a parametrize list, with the cases named in `bench` wrapped in
    `pytest.param(..., marks=pytest.mark.bench)` and those in `soak` marked soak: a second or third case
    of a property this test checks in the main tier moves to CI's bench tier (or, too long for CI, to
    the soak tier) for this test only. A case is named by its value where the values are strings, else
    by its index. A case not named (one appended to the list, say) runs in the main tier. `unpack`: each value
    is a tuple of several argnames' values."""
    values = list(values)
    names = {}
    for tier, cases in (("bench", bench), ("soak", soak)):
        for c in cases:
            i = values.index(c) if isinstance(c, str) and c in values else c
            if not isinstance(i, int) or not 0 <= i < len(values) or i in names:
                raise ValueError(f"tiered: {tier} names {c!r}, which is not one of the {len(values)} values "
                                 "(a string value, or an index) or is named twice")
            names[i] = getattr(pytest.mark, tier)
    return [(pytest.param(*v, marks=names[i]) if unpack else pytest.param(v, marks=names[i])) if i in names else v
            for i, v in enumerate(values)]
