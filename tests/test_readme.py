"""The README's code example runs as written (docs that match the code)."""

import pathlib
import re


def test_readme_example_runs():
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["out"].shape == (4, 8, 64)
    assert bool(scope["ok"])
    assert [int(x) for x in scope["slot_mapping"][2:]] == [-1, -1]
