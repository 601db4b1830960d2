"""The docs site's check (mkdocs.yml, `mkdocs build --strict` in .ci/run) fails on what it is there to catch: a
broken link, a broken anchor, a page left out of the nav. Each is built as a two-page site with the repository's
own mkdocs.yml settings; the repository's site itself is built by .ci/run."""

import pathlib
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).parents[1]


def build(tmp_path, pages: dict, nav: list) -> subprocess.CompletedProcess:
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    cfg.update(docs_dir=str(tmp_path / "docs"), site_dir=str(tmp_path / "site"), nav=nav)
    (tmp_path / "docs").mkdir(parents=True)
    for name, text in pages.items():
        (tmp_path / "docs" / name).write_text(text)
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml")],
                          capture_output=True, text=True, timeout=120, env={"NO_MKDOCS_2_WARNING": "1",
                                                                            "PATH": "/usr/bin:/bin"})


GOOD = {"index.md": "# Home\n\nSee [the page](page.md#a-section).\n", "page.md": "# Page\n\n## A section\n"}


@pytest.mark.parametrize("pages,nav,named", [
    ({**GOOD, "index.md": "# Home\n\nSee [the page](pgae.md).\n"}, ["index.md", "page.md"], "pgae.md"),
    ({**GOOD, "index.md": "# Home\n\nSee [the page](page.md#no-such).\n"}, ["index.md", "page.md"], "no-such"),
    ({**GOOD, "extra.md": "# Extra\n"}, ["index.md", "page.md"], "extra.md"),
], ids=["link", "anchor", "omitted-page"])
def test_the_strict_build_fails_and_names_the_fault(tmp_path, pages, nav, named):
    ok = build(tmp_path / "good", GOOD, ["index.md", "page.md"])
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = build(tmp_path / "bad", pages, nav)
    assert bad.returncode != 0 and named in bad.stderr, bad.stderr[-2000:]


def test_every_docs_page_is_in_the_nav_and_the_readme_links_exist():
    def pages(entries):   # a nav entry is a page, {title: page} or {title: [entries]}
        for entry in entries:
            for v in (entry.values() if isinstance(entry, dict) else [entry]):
                yield from (pages(v) if isinstance(v, list) else [v])

    listed = set(pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))
    assert listed == {p.name for p in (ROOT / "docs").glob("*.md")}
    import re

    for target in re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text()):
        assert (ROOT / target).is_file(), f"README links {target}, which does not exist"
