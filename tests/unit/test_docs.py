"""The documentation, checked without building it (``mkdocs build --strict`` in
.ci/run checks the site itself): every Python block in README.md and docs/
compiles; every relative link resolves, to a file and to a heading of a Markdown
page; the home page's snippets name README sections that exist; the README and
the home page list the same pages; and every repository path or test file named
in the documentation, or in a comment or docstring of the sources, exists, so a
moved file cannot leave a stale reference behind."""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: The Markdown a reader opens: the front page, the manual, the benchmarks' own page.
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), ROOT / "benchmarks" / "README.md"]
#: Where the Python sources live (the repository's top-level .py files too).
SOURCE_DIRS = ("parallelx", "backends", "recipes", "tests", "scripts", "benchmarks", "examples")
#: Files whose `#` comments are read like the Python sources' comments.
SHELL_FILES = [
    "Makefile",
    ".ci/run",
    "constraints.txt",
    *[f"scripts/{p.name}" for p in (ROOT / "scripts").glob("*.sh")],
]

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)")
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
SNIPPET = re.compile(r'^--8<-- "(?P<file>[^":]+)(?::(?P<section>[\w-]+))?"\s*$', re.M)
#: A path inside the repository: a top-level folder, then a name (not part of a URL or an absolute path).
REPO_PATH = re.compile(
    r"(?<![\w./-])(?P<path>(?:\.ci|tests|parallelx|backends|recipes|scripts|benchmarks|examples|docs)/[\w./-]*)"
)
#: A test file named alone (``test_resume.py``): it must exist somewhere under tests/.
TEST_FILE = re.compile(r"(?<![\w/.-])(?P<name>test_\w+\.py)\b")


def markdown_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(first line number, language, source) of every fenced code block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence, indent = i + 1, m["fence"], len(m["indent"])
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        blocks.append((start + 1, m["lang"].lower(), "\n".join(body) + "\n"))
        i += 1
    return blocks


def prose(text: str, code_spans: bool = False) -> str:
    """The text outside fenced blocks, and outside inline code spans unless ``code_spans``."""
    kept, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m["fence"]
            kept.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            kept.append("")
            continue
        kept.append(line if code_spans else re.sub(r"(`+)(?:(?!\1).)+?\1", "", line))
    return "\n".join(kept)


def slug(heading: str) -> str:
    """A heading's anchor, as Python-Markdown's toc (mkdocs) and GitHub make it."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    return {
        slug(m[1]) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(path.read_text(), code_spans=True), re.M)
    }


@pytest.mark.parametrize("path", MARKDOWN, ids=markdown_id)
def test_every_python_block_compiles(path):
    blocks = [(line, src) for line, lang, src in fenced_blocks(path.read_text()) if lang in ("python", "py")]
    for line, src in blocks:
        try:
            compile(textwrap.dedent(src), f"{markdown_id(path)}:{line}", "exec")
        except SyntaxError as exc:
            pytest.fail(f"{markdown_id(path)}: the Python block at line {line} does not compile: {exc}")


@pytest.mark.parametrize("path", MARKDOWN, ids=markdown_id)
def test_relative_links_resolve(path):
    broken = []
    for m in LINK.finditer(prose(path.read_text())):
        target = m["target"]
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{markdown_id(path)}: broken links: " + "; ".join(broken)


def test_snippets_name_sections_that_exist():
    """docs/index.md takes its sections from README.md through pymdownx.snippets."""
    used = []
    for path in DOCS.rglob("*.md"):
        for m in SNIPPET.finditer(path.read_text()):
            source = ROOT / m["file"]
            assert source.exists(), f"{markdown_id(path)} includes {m['file']}, which does not exist"
            if m["section"]:
                text = source.read_text()
                for edge in ("start", "end"):
                    marker = f"--8<-- [{edge}:{m['section']}]"
                    assert marker in text, (
                        f"{markdown_id(path)} includes section {m['section']!r} but {m['file']} has no {marker}"
                    )
                section = text.split(f"[start:{m['section']}]", 1)[1].split(f"[end:{m['section']}]", 1)[0]
                # Included into docs/, a relative link would point elsewhere than it does in the README.
                links = [lm["target"] for lm in LINK.finditer(prose(section)) if not re.match(r"[a-z]+:", lm["target"])]
                assert not links, (
                    f"README section {m['section']!r} is included in {markdown_id(path)}: keep relative links out of it: {links}"
                )
            used.append(m["section"])
    assert used, "docs/index.md should take its sections from README.md"


def page_table(path: Path, prefix: str) -> list[str]:
    """The pages a table of links lists, in order, relative to docs/."""
    rows = re.findall(r"^\| \[[^\]]+\]\(([^)#]+\.md)\) \|", path.read_text(), re.M)
    return [row.removeprefix(prefix) for row in rows]


def test_readme_and_home_page_list_the_same_pages():
    readme, home = page_table(ROOT / "README.md", "docs/"), page_table(DOCS / "index.md", "")
    assert readme, "README.md lost its table of documentation pages"
    assert readme == home, f"README.md lists {readme}, docs/index.md lists {home}: keep the two tables the same"
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    missing = [p for p in pages if p not in readme]
    assert not missing, f"docs pages that README.md does not link: {missing}"


def source_files() -> list[Path]:
    files = sorted(ROOT.glob("*.py"))
    for folder in SOURCE_DIRS:
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    source = path.read_text()
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            found.append((first.lineno, first.value.value))
    return found


def texts_to_check() -> list[tuple[str, int, str]]:
    """(file, first line, text): the Markdown pages whole, the sources' comments and docstrings."""
    texts = [(markdown_id(p), 1, p.read_text()) for p in MARKDOWN]
    for path in source_files():
        texts += [(markdown_id(path), line, text) for line, text in comments_and_docstrings(path)]
    for name in SHELL_FILES:
        for no, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            if "#" in line:
                texts.append((name, no, line[line.index("#") :]))
    return texts


def missing_references(texts: list[tuple[str, int, str]]) -> list[str]:
    """``file:line: name`` for each repository path or test file named in ``texts`` that does not exist."""
    test_files = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    missing = []
    for name, first, text in texts:
        found = [(m.start(), m["path"].rstrip(".,:;"), m.end()) for m in REPO_PATH.finditer(text)]
        for start, path, end in found:
            if text[end : end + 1] in ("<", "*", "{", "$"):
                continue  # a pattern (backends/<name>.py, tests/test_*.py), not a path
            if not (ROOT / path).exists():
                missing.append(f"{name}:{first + text.count(chr(10), 0, start)}: {path}")
        for m in TEST_FILE.finditer(text):
            if m["name"] not in test_files:
                missing.append(f"{name}:{first + text.count(chr(10), 0, m.start())}: {m['name']}")
    return missing


def test_named_paths_and_test_files_exist():
    missing = missing_references(texts_to_check())
    assert not missing, f"{len(missing)} reference(s) to a file that does not exist (moved? renamed?): " + "; ".join(
        missing
    )


def test_the_reference_check_sees_a_stale_path():
    """The check above can fail: a moved test file, a missing conftest, a bare test name."""
    stale = [
        ("a.md", 1, "# A page\n\nsee `tests/test_resume.py` for the faults"),
        ("b.py", 3, "# the core launch (tests/launcher/conftest.py)"),
        ("c.py", 1, "A docstring:\ncompared by test_no_such_thing.py."),
        (
            "d.md",
            1,
            "`tests/system/test_resume.py`, `backends/<name>.py`, `tests/test_*.py`, `docs/loops.md`, test_resume.py.",
        ),
    ]
    assert missing_references(stale) == [
        "a.md:3: tests/test_resume.py",
        "b.py:3: tests/launcher/conftest.py",
        "c.py:2: test_no_such_thing.py",
    ]
