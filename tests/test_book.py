"""The book (scripts/book.py): its pages, pictures and links, and the check that guards them.

Two kinds of test. The first kind runs in `make test` and takes a few seconds: a notebook
renders every one of its pictures; each stage's lesson diff keeps every changed line; a book
built from the committed notebooks (no outputs, so no executing) passes the check, and the same
book, broken in one way at a time, fails it, naming what broke.

The second kind, marked `book`, checks the book `make book` built, where WORKBOOK_BOOK names
it, as `make book-check` does (CI runs that after `make test`, which executes the notebooks): every
stage page there, every notebook page with as many pictures as its executed copy, every internal
link and image resolving; a copy of it with a picture and a page taken away fails the check, and
one with a console error, a missing picture and a fetch from the network fails the browser check
(scripts/book_browser.py, with Debian's chromium, which .ci/run installs).
"""

import base64
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workbook.build import stages

REPO = stages.REPO


def _script(name: str, module: str):
    """scripts/<name>, imported by path (scripts/ is not a package) as `module`; registered
    before it runs, as its dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(module, REPO / "scripts" / name)
    loaded = sys.modules[module] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


# book.py imports run_notebooks.py, which lies beside it: where Python finds it when book.py is run
# as a script, and where this test puts it for the import.
_script("run_notebooks.py", "run_notebooks")
book = _script("book.py", "book_script")

# A 1 x 1 PNG, as a notebook stores an image output.
PIXEL = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360f8cf00000301010018dd8db00000000049454e44ae426082")).decode()
BUILT = os.environ.get("WORKBOOK_BOOK")
# The tests of the book `make book` built are marked `book`: `make test` leaves them out (there
# is no built book yet), `make book-check` builds it and runs them, with WORKBOOK_BOOK set.
needs_built_book = pytest.mark.book


def built_book() -> Path:
    assert BUILT, "this test checks the book make book built: run it with make book-check"
    return Path(BUILT)


def picture_output():
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": PIXEL, "text/plain": "<Figure>"}}


def tiny_notebook(pictures):
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# A notebook\n\nSome *text*."}]
    for i in range(pictures):
        cells.append({"cell_type": "code", "metadata": {}, "execution_count": i + 1,
                      "source": f"draw({i})",
                      "outputs": [{"output_type": "stream", "name": "stdout", "text": "drawn\n"},
                                  picture_output()]})
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_a_notebook_shows_every_picture_and_printed_line(tmp_path):
    nb = tiny_notebook(3)
    assert book.count_images(nb) == 3
    site = book.Book(tmp_path / "book", tmp_path)
    html = book.render_notebook(nb, site, "nb")
    assert html.count('class="nb-picture"') == 3
    assert html.count("drawn") == 3
    assert sorted(p.name for p in (tmp_path / "book" / "img" / "nb").iterdir()) == \
        ["01.png", "02.png", "03.png"]


def test_an_output_the_book_cannot_show_is_an_error(tmp_path):
    nb = tiny_notebook(0)
    nb["cells"].append({"cell_type": "code", "metadata": {}, "execution_count": 1, "source": "x",
                        "outputs": [{"output_type": "display_data", "metadata": {},
                                     "data": {"application/x-unknown": "?"}}]})
    with pytest.raises(book.BookError, match="application/x-unknown"):
        book.render_notebook(nb, book.Book(tmp_path / "book", tmp_path), "nb")


@pytest.mark.parametrize("stage", [s for s in stages.all_stages() if s.lesson],
                         ids=lambda s: s.folder)
def test_the_lesson_diff_keeps_every_changed_line(stage):
    text = stages.lesson_diff(stage)
    # Every line starting with + or -, less the two header lines of each pair that differs.
    marked = sum(ln.startswith(("+", "-")) for ln in text.splitlines())
    differing = len(stage.lesson) - text.count(" are the same)\n")
    changed = marked - 2 * differing
    files = book.parse_lesson_diff(text)
    assert sum(f.changed for f in files) == changed
    assert [f.after for f in files if f.rows] == [os.path.normpath(f"stages/{after}")
                                                 for _, after in stage.lesson
                                                 if f"stages/{after}" in text]
    # Coloured as the source it comes from: a changed line of C++ or Python carries spans.
    rendered = book.diff_html(files)
    assert rendered.count('<tr class="add">') + rendered.count('<tr class="del">') == changed
    assert "<span" in rendered


@pytest.fixture(scope="module")
def small_book(tmp_path_factory):
    """A book built from the committed notebooks as they are (no outputs, nothing executed)."""
    root = tmp_path_factory.mktemp("book")
    executed = root / "executed"
    executed.mkdir()
    for nb in book.find_notebooks():
        shutil.copy(nb, executed / nb.name)
    out = root / "book"
    site = book.Book(out, executed)
    site.footer = "test footer"
    site.build()
    return out, executed


def broken_copy(small_book, tmp_path):
    out, executed = small_book
    shutil.copytree(out, tmp_path / "book")
    shutil.copytree(executed, tmp_path / "executed")
    return tmp_path / "book", tmp_path / "executed"


def test_a_built_book_passes_the_check(small_book):
    out, executed = small_book
    assert book.check(out, executed) == []
    for s in stages.all_stages():
        page = (out / f"{s.folder}.html").read_text()
        assert f"make diff {s.number}" in page
        assert "test footer" in page


def test_the_check_fails_on_a_missing_stage_page(small_book, tmp_path):
    out, executed = broken_copy(small_book, tmp_path)
    last = stages.all_stages()[-1]
    (out / f"{last.folder}.html").unlink()
    problems = book.check(out, executed)
    assert f"page {last.folder}.html is missing" in problems
    assert any("points at a missing file" in p for p in problems)


def test_the_check_fails_when_a_picture_is_not_shown(small_book, tmp_path):
    out, executed = broken_copy(small_book, tmp_path)
    first = book.find_notebooks()[0]
    nb = json.loads((executed / first.name).read_text())
    code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    code["outputs"] = [picture_output()]
    (executed / first.name).write_text(json.dumps(nb))
    assert f"{first.name}: the book shows 0 pictures, the executed notebook holds 1" in \
        book.check(out, executed)


def test_the_check_fails_on_a_broken_link_an_anchor_and_a_network_resource(small_book, tmp_path):
    out, executed = broken_copy(small_book, tmp_path)
    index = out / "index.html"
    index.write_text(index.read_text().replace(
        "</main>", '<a href="nowhere.html">x</a><a href="exercises.html#no-such-id">y</a>'
        '<script src="https://cdn.example/require.js"></script></main>'))
    problems = book.check(out, executed)
    assert 'index.html: <a href="nowhere.html"> points at a missing file' in problems
    assert "index.html: link exercises.html#no-such-id: no id 'no-such-id' there" in problems
    assert "index.html: <script src> loads https://cdn.example/require.js from the network" in \
        problems


@needs_built_book
def test_the_built_book_has_every_page_picture_and_link():
    out = built_book()
    executed = book.build_root() / "notebooks"
    assert book.check(out, executed) == []
    pictures = sum(book.count_images(json.loads((executed / nb.name).read_text()))
                   for nb in book.find_notebooks())
    assert pictures > 0, "the executed notebooks hold no picture at all"
    assert len(list((out / "img").rglob("*.png"))) >= pictures


@needs_built_book
def test_the_check_fails_on_a_copy_of_the_built_book_missing_a_picture_and_a_page(tmp_path):
    out = tmp_path / "book"
    shutil.copytree(built_book(), out)
    executed = book.build_root() / "notebooks"
    picture = sorted((out / "img").rglob("*.png"))[-1]  # the last notebook's, not stage 1's
    picture.unlink()
    first = stages.all_stages()[0]
    (out / f"{first.folder}.html").unlink()
    problems = book.check(out, executed)
    assert f"page {first.folder}.html is missing" in problems
    assert any(p.endswith("points at a missing file") and picture.name in p for p in problems)


@needs_built_book
def test_the_browser_check_fails_on_a_console_error_a_missing_image_and_a_fetch(tmp_path):
    assert shutil.which("chromium"), "no chromium: apt-get install chromium (.ci/run does)"
    out = tmp_path / "book"
    shutil.copytree(built_book(), out, ignore=shutil.ignore_patterns("shots"))
    picture = sorted((out / "img").rglob("*.png"))[0]
    picture.unlink()
    index = out / "index.html"
    index.write_text(index.read_text().replace(
        "</main>", '<script>console.error("planted");</script>'
        '<img src="https://example.invalid/x.png"></main>'))
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "book_browser.py"),
                           "--book", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "console error: planted" in proc.stdout
    assert "a request to the network: https://example.invalid/x.png" in proc.stdout
    assert f"image not loaded: {picture.relative_to(out).as_posix()}" in proc.stdout
    assert (out / "shots" / "start.png").is_file()


def test_an_executed_copy_is_current_until_its_notebook_or_an_input_changes(tmp_path):
    source, inputs, copy = tmp_path / "01_x.ipynb", tmp_path / "common", tmp_path / "copy.ipynb"
    inputs.mkdir()
    (inputs / "helper.py").write_text("x = 1\n")
    source.write_text(json.dumps(tiny_notebook(0)))
    assert book.why_stale(source, copy, book.newest_in([inputs])) == "not executed yet"
    copy.write_text(json.dumps(tiny_notebook(1)))
    for path, age in ((source, 30), (inputs / "helper.py", 20), (copy, 10)):
        os.utime(path, (path.stat().st_mtime - age,) * 2)
    assert book.why_stale(source, copy, book.newest_in([inputs])) is None
    os.utime(inputs / "helper.py")  # edited now, after the copy ran
    assert book.why_stale(source, copy, book.newest_in([inputs])).endswith(
        "helper.py changed since")
    os.utime(copy)
    failed = tiny_notebook(1)
    failed["cells"][1]["outputs"].append({"output_type": "error", "ename": "E", "evalue": "",
                                          "traceback": []})
    copy.write_text(json.dumps(failed))
    assert book.why_stale(source, copy, book.newest_in([inputs])) == "cell 1 ended in an error"
