"""The README's code examples run as written (docs that match the code)."""

import pathlib
import re

import pytest


def _example(marker: str) -> str:
    """The README's ```python block that contains `marker`."""
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b]
    assert len(blocks) == 1, f"one README python block with {marker!r}; found {len(blocks)}"
    return blocks[0]


@pytest.mark.soak
def test_readme_llm_example_runs():
    # The same lines with the tiny random model in place of SmolLM2 (no wheel, seconds not minutes).
    code = _example("LLM(").replace('"smollm2-135m", max_seqs=32', '"tiny-llama", max_seqs=4, num_pages=64')
    assert '"tiny-llama"' in code, "the README example's first line changed: update this test"
    code = code.replace("print(", "_ = (")
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert len(scope["outs"][0].token_ids) == 16 or scope["outs"][0].finish_reason == "stop"
    assert scope["chat"][0].prompt.startswith("<|im_start|>user\nName three rivers.")


def test_readme_example_runs():
    code = _example("jpa.CacheConfig(")
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["out"].shape == (4, 8, 64)
    assert bool(scope["ok"])
    assert [int(x) for x in scope["slot_mapping"][2:]] == [-1, -1]


def test_the_library_page_shows_the_readmes_examples():
    """docs/library.md repeats the README's two examples for the docs site: the same code, so the tests above
    cover both."""
    page = (pathlib.Path(__file__).parents[1] / "docs" / "library.md").read_text()
    for marker in ("LLM(", "jpa.CacheConfig("):
        assert f"```python\n{_example(marker)}```" in page, f"docs/library.md's {marker} example differs from README's"
