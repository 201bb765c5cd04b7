"""make book: the workbook as a static site, build/book/, to read in a browser with no server.

    python scripts/book.py                  build the book (executes the notebooks whose executed
                                            copies are missing or stale), then check it
    python scripts/book.py --reuse          use the executed copies in build/notebooks/ as they
                                            are, stale or not (quick, to work on the book itself)
    python scripts/book.py --check          only check an existing book: every page, image and link

What goes in, all found on disk (nothing here lists stages or notebooks): a start page from the
README (its opening and its Learn section) with the stage table; a page per stage with its
README (the lesson), its lesson diff (`make diff N`, syntax-coloured) and its notebook as
executed, every printed result and picture; a page per appendix notebook; the exercises
(workbook.teaching.exercises); the benchmark results (bench/results/<op>/*.md and their plots). Each
page's footer says which torch on which machine produced the outputs, and when.

The executed notebooks are the copies `make notebooks` (and the notebook test of `make test`)
write to build/notebooks/. A copy is current when it has no error output and is newer than its
notebook and than every file it may import or read: under common/, bench/results/, and its own
stage folder and those of the stages before it (all of them for an appendix). The others are
executed again with scripts/run_notebooks.py, the same runner; a notebook that fails stops the
book (it shows executed notebooks only). --reuse (make book REUSE=1) shows the copies as they are.

No network: the pages link no script, font or style sheet from elsewhere (there is no script at
all); the styles are scripts/book_theme/book.css and Pygments' colours, written beside the pages.
Markdown is rendered by mistune, code and diffs are coloured by Pygments (requirements-book.txt).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime
import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import run_notebooks  # scripts/run_notebooks.py, beside this file: the notebooks, how they run

from workbook.build import stages
from workbook.teaching import exercises

REPO = stages.REPO

NOTEBOOKS = run_notebooks.NOTEBOOKS
THEME = REPO / "scripts" / "book_theme"
RUNNER = REPO / "scripts" / "run_notebooks.py"
# Read by every notebook: a change under these makes its executed copy stale (so does a change to
# its own stage or an earlier one: inputs_of).
NOTEBOOK_INPUTS = ("common", "bench/results")
SKIPPED_PARTS = {"__pycache__", "build", ".ipynb_checkpoints", ".pytest_cache"}
APPENDIX = re.compile(r"^A\d+_")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
IMAGE_TYPES = {"image/png": ".png", "image/jpeg": ".jpg", "image/gif": ".gif",
               "image/svg+xml": ".svg"}
# Output types shown, in order of preference: an image first (so every picture is counted), then
# the richest text.
SHOWN_TYPES = (*IMAGE_TYPES, "text/html", "text/markdown", "text/latex", "text/plain")


class BookError(RuntimeError):
    """Something the book cannot be built from; says what and where."""


def build_root() -> Path:
    return Path(os.environ.get("WORKBOOK_BUILD_DIR", REPO / "build")).resolve()


def log(message: str) -> None:
    print(f"[book] {message}", flush=True)


def rel(path: Path) -> str:
    path = Path(os.path.abspath(path))
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


# ----------------------------------------------------------------------------------------------
# The sources: notebooks, their executed copies, the stages


def find_notebooks() -> list[Path]:
    """Stage notebooks (NN_name) in order, then appendices (A1_name, ...): `make notebooks`'."""
    return run_notebooks.find_notebooks([])


def stage_notebook(s: stages.Stage) -> Path | None:
    found = sorted(NOTEBOOKS.glob(f"{s.number:02d}_*.ipynb"))
    return found[0] if found else None


def appendices() -> list[Path]:
    return [p for p in find_notebooks() if APPENDIX.match(p.name)]


def inputs_of(notebook: Path) -> list[Path]:
    """What a notebook may import or read: common/, bench/results/, and the stage folders up to
    its own (a stage's notebook builds on and compares with the stages before it); all of them
    for an appendix."""
    number = int(notebook.name[:2]) if notebook.name[:2].isdigit() else None
    folders = [REPO / top for top in NOTEBOOK_INPUTS]
    folders += [s.source_dir for s in stages.all_stages() if number is None or s.number <= number]
    return folders


def newest_in(folders: list[Path]) -> tuple[float, Path | None]:
    """The newest file under the folders (build leftovers skipped), and its time."""
    newest, which = 0.0, None
    for top in folders:
        for folder, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d not in SKIPPED_PARTS and not d.endswith(".egg-info")]
            for name in files:
                path = Path(folder) / name
                mtime = path.stat().st_mtime
                if mtime > newest:
                    newest, which = mtime, path
    return newest, which


def error_outputs(nb: dict) -> list[int]:
    return [i for i, cell in enumerate(nb["cells"])
            if any(o.get("output_type") == "error" for o in cell.get("outputs", []))]


def why_stale(notebook: Path, executed: Path, inputs: tuple[float, Path | None]) -> str | None:
    """Why the executed copy cannot be shown as it is, or None when it is current."""
    if not executed.is_file():
        return "not executed yet"
    when = executed.stat().st_mtime
    if notebook.stat().st_mtime > when:
        return "the notebook changed since"
    newest, which = inputs
    if newest > when:
        return f"{rel(which)} changed since"
    errors = error_outputs(json.loads(executed.read_text()))
    if errors:
        return f"cell {errors[0]} ended in an error"
    return None


def executed_copies(notebooks: list[Path], executed_dir: Path, reuse: bool) -> dict[Path, Path]:
    """notebook -> its current executed copy, executing (with run_notebooks.py) those that are
    missing or stale."""
    stale = {}
    for nb in notebooks:
        copy = executed_dir / nb.name
        reason = why_stale(nb, copy, newest_in(inputs_of(nb)))
        if reason and reuse and copy.is_file():
            log(f"{nb.name}: stale ({reason}), shown as it is (--reuse)")
        elif reason:
            stale[nb] = reason
            log(f"{nb.name}: to execute ({reason})")
    if stale:
        log(f"executing {len(stale)} of {len(notebooks)} notebooks (minutes; the notebook "
            f"runner's progress follows)")
        proc = subprocess.run([sys.executable, str(RUNNER), *(p.name for p in stale)], cwd=REPO)
        if proc.returncode != 0:
            raise BookError("a notebook failed to execute (see the runner's output above); the "
                            "book shows executed notebooks only")
    else:
        log(f"no notebook to execute: reusing the executed copies in {rel(executed_dir)}")
    missing = [nb.name for nb in notebooks if not (executed_dir / nb.name).is_file()]
    if missing:
        raise BookError(f"no executed copy of {', '.join(missing)} in {executed_dir}")
    return {nb: executed_dir / nb.name for nb in notebooks}


# ----------------------------------------------------------------------------------------------
# Rendering: Markdown, code, diffs


def _lexer(name: str | None = None, filename: str | None = None):
    from pygments.lexers import TextLexer, get_lexer_by_name, get_lexer_for_filename
    from pygments.util import ClassNotFound

    try:
        if filename:
            if filename.endswith((".cu", ".cuh")):  # CUDA reads best as C++ (its lexer is thin)
                return get_lexer_by_name("cpp", stripnl=False)
            return get_lexer_for_filename(filename, stripnl=False)
        return get_lexer_by_name(name or "text", stripnl=False)
    except ClassNotFound:
        return TextLexer(stripnl=False)


def highlight(code: str, language: str | None = None, filename: str | None = None) -> str:
    """Code as coloured HTML lines, without the surrounding <pre>."""
    from pygments import highlight as pygments_highlight
    from pygments.formatters import HtmlFormatter

    return pygments_highlight(code, _lexer(language, filename), HtmlFormatter(nowrap=True))


def code_block(code: str, language: str | None = None, css: str = "") -> str:
    return f'<pre class="hl {css}">{highlight(code, language)}</pre>'


class Links:
    """Where a relative link or image of a Markdown source points in the book.

    A link to another stage's README or to a notebook goes to that page; to any other file of the
    repository, to the file itself (relative to build/book/, so it resolves in a local clone);
    an image is copied into the book, beside the pages.
    """

    def __init__(self, book: Book, source_dir: Path):
        self.book, self.source_dir = book, source_dir

    def url(self, url: str, image: bool = False) -> str:
        parts = urlsplit(url)
        if parts.scheme or parts.netloc or url.startswith("#") or not parts.path:
            return url
        target = (self.source_dir / unquote(parts.path)).resolve()
        fragment = f"#{parts.fragment}" if parts.fragment else ""
        if image and target.is_file():
            copied = self.book.copy_file(target)
            return copied
        page = self.book.page_of_source.get(target)
        if page:
            return page + fragment
        return os.path.relpath(target, self.book.out) + fragment


def slug(text: str) -> str:
    text = re.sub(r"<[^>]+>", "", html.unescape(text)).lower()
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "section"


def markdown(text: str, links: Links | None = None) -> str:
    """Markdown as HTML: GitHub's tables, fenced code coloured by Pygments, headings with ids."""
    import mistune

    class Renderer(mistune.HTMLRenderer):
        def block_code(self, code, info=None):
            language = info.split()[0] if info else None
            return code_block(code, language)

        def heading(self, text, level, **attrs):
            return f'<h{level} id="{slug(text)}">{text}</h{level}>\n'

        def link(self, text, url, title=None):
            return super().link(text, links.url(url) if links else url, title)

        def image(self, text, url, title=None):
            return super().image(text, links.url(url, image=True) if links else url, title)

    render = mistune.create_markdown(escape=True, renderer=Renderer(escape=True),
                                     plugins=["table", "strikethrough", "url"])
    return render(text)


def inline_markdown(text: str) -> str:
    """One line of Markdown as inline HTML (no paragraph around it)."""
    return re.sub(r"^<p>(.*)</p>$", r"\1", markdown(text).strip(), flags=re.S)


@dataclasses.dataclass
class DiffFile:
    before: str
    after: str
    rows: list[tuple[str, int | None, int | None, str]]  # (kind, old line, new line, html)
    note: str = ""

    @property
    def changed(self) -> int:
        return sum(kind in ("add", "del") for kind, *_ in self.rows)


def _file_lines(path: Path) -> tuple[list[str], list[str]]:
    """A file's lines, plain and coloured (one self-contained line of HTML each)."""
    text = path.read_text()
    plain = text.splitlines()
    coloured = highlight(text + "\n", filename=path.name).split("\n")
    if len(coloured) < len(plain):  # a lexer that merged lines: fall back to plain text
        coloured = [html.escape(line) for line in plain]
    return plain, coloured


def parse_lesson_diff(text: str) -> list[DiffFile]:
    """The unified diff `python -m workbook.build.stages --diff N` prints, as rows to draw, each
    line coloured as the file it comes from (whole files are highlighted, so a comment spanning
    lines stays a comment)."""
    files: list[DiffFile] = []
    old = new = 0
    sources: dict[str, tuple[list[str], list[str]]] = {}
    hunk = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
    same = re.compile(r"^\((\S+) and (\S+) are the same\)$")

    def lines_of(name: str) -> tuple[list[str], list[str]]:
        if name not in sources:
            path = REPO / name
            sources[name] = _file_lines(path) if path.is_file() else ([], [])
        return sources[name]

    def row(which: str, number: int, text: str) -> str:
        plain, coloured = lines_of(which)
        if 0 < number <= len(plain) and plain[number - 1] == text:
            return coloured[number - 1]
        return html.escape(text)

    left = right = 0  # lines of the current hunk still to come, before and after
    for line in text.splitlines():
        if left or right:  # inside a hunk: its counts say where it ends, whatever a line holds
            kind = {" ": "ctx", "-": "del", "+": "add"}.get(line[:1])
            if kind is None:
                raise BookError(f"the lesson diff of {files[-1].after}: a hunk line starting "
                                f"with {line[:1]!r}: {line!r}")
            code = line[1:]
            if kind == "ctx":
                files[-1].rows.append((kind, old, new, row(files[-1].before, old, code)))
                old, new, left, right = old + 1, new + 1, left - 1, right - 1
            elif kind == "del":
                files[-1].rows.append((kind, old, None, row(files[-1].before, old, code)))
                old, left = old + 1, left - 1
            else:
                files[-1].rows.append((kind, None, new, row(files[-1].after, new, code)))
                new, right = new + 1, right - 1
        elif line.startswith("--- "):
            files.append(DiffFile(os.path.normpath(line[4:]), "", []))
        elif line.startswith("+++ ") and files and not files[-1].after:
            files[-1].after = os.path.normpath(line[4:])
        elif match := hunk.match(line):
            old, left, new, right = (int(match.group(i) or 1) for i in range(1, 5))
            files[-1].rows.append(("hunk", None, None, html.escape(line)))
        elif match := same.match(line):
            files.append(DiffFile(os.path.normpath(match.group(1)),
                                  os.path.normpath(match.group(2)), [], "the same file"))
        elif line.strip():
            files.append(DiffFile("", "", [], line))
    return files


def diff_html(files: list[DiffFile]) -> str:
    out = []
    for f in files:
        if not f.before:
            out.append(f"<p>{html.escape(f.note)}</p>")
            continue
        added = sum(k == "add" for k, *_ in f.rows)
        removed = sum(k == "del" for k, *_ in f.rows)
        out.append(f'<div class="diff-file"><div class="diff-head"><code>{html.escape(f.before)}'
                   f'</code> &rarr; <code>{html.escape(f.after)}</code>'
                   f'<span class="diff-count"><span class="add">+{added}</span> '
                   f'<span class="del">&minus;{removed}</span></span></div>')
        if f.note:
            out.append(f"<p>{html.escape(f.note)}</p></div>")
            continue
        out.append('<table class="diff hl"><colgroup><col class="ln"><col class="ln">'
                   '<col class="sign"><col></colgroup>')
        sign = {"add": "+", "del": "-", "ctx": " "}
        for kind, a, b, code in f.rows:
            if kind == "hunk":
                out.append(f'<tr class="hunk"><td></td><td></td><td colspan="2">{code}</td></tr>')
            else:
                out.append(f'<tr class="{kind}"><td class="ln">{a or ""}</td>'
                           f'<td class="ln">{b or ""}</td><td class="sign">{sign[kind]}</td>'
                           f"<td><pre>{code or ' '}</pre></td></tr>")
        out.append("</table></div>")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Rendering: notebooks


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def count_images(nb: dict) -> int:
    """The pictures an executed notebook holds: outputs with an image."""
    return sum(any(t in IMAGE_TYPES for t in o.get("data", {}))
               for cell in nb["cells"] for o in cell.get("outputs", []))


def render_notebook(nb: dict, book: Book, stem: str) -> str:
    """An executed notebook (nbformat 4, as JSON) as HTML; its images written to img/<stem>/."""
    out, picture = [], 0
    for index, cell in enumerate(nb["cells"]):
        source = _text(cell.get("source", ""))
        if cell["cell_type"] == "markdown":
            out.append(f'<div class="cell md">{markdown(source, Links(book, NOTEBOOKS))}</div>')
            continue
        if cell["cell_type"] != "code":
            continue
        count = cell.get("execution_count")
        out.append(f'<div class="cell code"><div class="prompt">[{count or " "}]</div>'
                   f'{code_block(source, "python", "input")}')
        for output in cell.get("outputs", []):
            kind = output.get("output_type")
            if kind == "stream":
                text = ANSI.sub("", _text(output.get("text", "")))
                out.append(f'<pre class="output {output.get("name", "stdout")}">'
                           f"{html.escape(text)}</pre>")
            elif kind == "error":
                text = ANSI.sub("", "\n".join(output.get("traceback", [])))
                out.append(f'<pre class="output error">{html.escape(text)}</pre>')
            elif kind in ("display_data", "execute_result"):
                data = output.get("data", {})
                shown = next((t for t in SHOWN_TYPES if t in data), None)
                if shown is None:
                    raise BookError(f"{stem}, cell {index}: an output of types "
                                    f"{', '.join(data) or 'none'}, none of which the book shows")
                if shown in IMAGE_TYPES:
                    picture += 1
                    name = f"img/{stem}/{picture:02d}{IMAGE_TYPES[shown]}"
                    payload = _text(data[shown])
                    blob = (payload.encode() if shown == "image/svg+xml"
                            else base64.b64decode(payload))
                    book.write(name, blob)
                    alt = html.escape(_text(data.get("text/plain", f"picture {picture}")))
                    out.append(f'<div class="output picture"><img class="nb-picture" '
                               f'src="{name}" alt="{alt}"></div>')
                elif shown == "text/html":
                    out.append(f'<div class="output html">{_text(data[shown])}</div>')
                elif shown == "text/markdown":
                    out.append(f'<div class="output md">{markdown(_text(data[shown]))}</div>')
                else:
                    out.append(f'<pre class="output result">'
                               f"{html.escape(ANSI.sub('', _text(data[shown])))}</pre>")
        out.append("</div>")
    return "\n".join(out)


def notebook_title(nb: dict, fallback: str) -> str:
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in _text(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


# ----------------------------------------------------------------------------------------------
# The machine that produced the outputs


def machine_facts(executed: list[Path]) -> str:
    """One line for the footer: which torch, which machine (and whether CUDA was real,
    emulated or absent), and when the notebooks were executed."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass
    cpu = f"{cpu}, {os.cpu_count()} cores"
    # The emulated CUDA device (workbook/build/emulate.py) labels what ran on it "emulated_cuda".
    outputs = " ".join(_text(o.get("text", "")) + _text(o.get("data", {}).get("text/plain", ""))
                       for p in executed for cell in json.loads(p.read_text())["cells"]
                       for o in cell.get("outputs", []))
    emulated = os.environ.get("WORKBOOK_CUDA") == "emulate" or "emulated_cuda" in outputs
    if torch.cuda.is_available() and os.environ.get("WORKBOOK_CUDA") != "emulate":
        gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        where = f"GPU: {gpus}; CPU: {cpu}"
    elif emulated:
        where = (f"no GPU: CUDA kernels emulated on the CPU (emulated_cuda; not GPU timings), "
                 f"{cpu}")
    else:
        where = f"CPU only, no GPU (the CUDA cells were skipped): {cpu}"
    when = max((p.stat().st_mtime for p in executed), default=time.time())
    stamp = datetime.datetime.fromtimestamp(when, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"Outputs from torch {torch.__version__}, {where}; notebooks executed {stamp}."


# ----------------------------------------------------------------------------------------------
# The book


@dataclasses.dataclass
class PageInfo:
    file: str  # under build/book/
    title: str
    group: str  # the navigation group
    notebook: Path | None = None  # the notebook it shows, if any


class Book:
    def __init__(self, out: Path, executed_dir: Path):
        self.out, self.executed_dir = out, executed_dir
        self.stages = stages.all_stages()
        self.pages: list[PageInfo] = [PageInfo("index.html", "Start", "")]
        self.page_of_source: dict[Path, str] = {(REPO / "README.md").resolve(): "index.html"}
        for s in self.stages:
            page = PageInfo(f"{s.folder}.html", f"Stage {s.number}: {s.title}", "Stages",
                            stage_notebook(s))
            self.pages.append(page)
            self.page_of_source[(s.source_dir / "README.md").resolve()] = page.file
            if page.notebook:
                self.page_of_source[page.notebook.resolve()] = page.file
        for nb in appendices():
            title = notebook_title(json.loads(nb.read_text()), nb.stem).replace("`", "")
            page = PageInfo(f"{nb.stem}.html", title, "Appendices", nb)
            self.pages.append(page)
            self.page_of_source[nb.resolve()] = page.file
        self.pages.append(PageInfo("exercises.html", "Exercises", "More"))
        self.pages.append(PageInfo("bench.html", "Benchmark results", "More"))
        self.footer = ""

    def write(self, name: str, data: bytes | str) -> None:
        path = self.out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            path.write_text(data)
        else:
            path.write_bytes(data)

    def copy_file(self, source: Path) -> str:
        """A repository file copied into the book (files/<path in the repo>); its URL."""
        name = f"files/{rel(source)}"
        (self.out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, self.out / name)
        return name

    def nav(self, current: str) -> str:
        items, group = [], None
        for p in self.pages:
            if p.group != group:
                group = p.group
                if group:
                    items.append(f'<li class="group">{html.escape(group)}</li>')
            mark = ' class="current"' if p.file == current else ""
            label = p.title.split(":")[0] if p.group in ("Stages", "Appendices") else p.title
            items.append(f'<li{mark}><a href="{p.file}" title="{html.escape(p.title)}">'
                         f"{html.escape(label)}</a></li>")
        return "<ul>" + "\n".join(items) + "</ul>"

    def page(self, info: PageInfo, body: str) -> None:
        index = self.pages.index(info)
        prev = self.pages[index - 1] if index > 0 else None
        nxt = self.pages[index + 1] if index + 1 < len(self.pages) else None
        steps = ""
        if prev:
            steps += f'<a class="prev" href="{prev.file}">&larr; {html.escape(prev.title)}</a>'
        if nxt:
            steps += f'<a class="next" href="{nxt.file}">{html.escape(nxt.title)} &rarr;</a>'
        self.write(info.file, f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(info.title)} · PyTorch C++/CUDA extensions workbook</title>
<link rel="stylesheet" href="assets/book.css">
<link rel="stylesheet" href="assets/pygments.css">
</head>
<body>
<nav class="side"><a class="home" href="index.html">C++/CUDA extensions workbook</a>
{self.nav(info.file)}</nav>
<main>
{body}
<div class="steps">{steps}</div>
<footer>{html.escape(self.footer)}</footer>
</main>
</body>
</html>
""")

    # -- pages ----------------------------------------------------------------------------------

    def start_page(self) -> str:
        readme = (REPO / "README.md").read_text()
        sections = re.split(r"^## ", readme, flags=re.M)
        opening = sections[0]
        learn = next((s for s in sections[1:] if s.startswith("Learn\n")), None)
        if learn is None:
            raise BookError("README.md has no `## Learn` section: the start page is made of it")
        links = Links(self, REPO)
        rows = []
        for s in self.stages:
            page = f"{s.folder}.html"
            parts = [f'<a href="{page}">lesson</a>',
                     f'<a href="{page}#the-lesson-as-a-diff">diff</a>']
            if stage_notebook(s):
                parts.append(f'<a href="{page}#the-notebook">notebook</a>')
            rows.append(f'<tr><td>{s.number}</td><td><a href="{page}"><code>{s.folder}</code>'
                        f"</a></td><td>{inline_markdown(s.title)}</td>"
                        f"<td>{' · '.join(parts)}</td></tr>")
        extra = "".join(f'<li><a href="{p.file}">{html.escape(p.title)}</a></li>'
                        for p in self.pages if p.group in ("Appendices", "More"))
        return (f"{markdown(opening, links)}"
                f'<h2 id="stages">The stages</h2><table class="stages"><tr><th>stage</th>'
                f"<th>folder</th><th>what it adds</th><th>read</th></tr>{''.join(rows)}</table>"
                f"<h2 id=\"learn\">Learn</h2>{markdown(learn.split(chr(10), 1)[1], links)}"
                f'<h2 id="more">Also here</h2><ul>{extra}</ul>')

    def notebook_section(self, notebook: Path) -> str:
        executed = self.executed_dir / notebook.name
        nb = json.loads(executed.read_text())
        return (f'<section class="notebook" data-notebook="{notebook.name}" '
                f'data-pictures="{count_images(nb)}">'
                f"{render_notebook(nb, self, notebook.stem)}</section>")

    def stage_page(self, s: stages.Stage, notebook: Path | None) -> str:
        readme = s.source_dir / "README.md"
        lesson = (markdown(readme.read_text(), Links(self, s.source_dir)) if readme.is_file()
                  else f"<p>{s.folder} has no README.md.</p>")
        if s.lesson:
            diff = diff_html(parse_lesson_diff(stages.lesson_diff(s)))
        elif s == self.stages[0]:
            diff = ("<p>The first stage: there is nothing before it to compare with, so its files "
                    "are the whole lesson.</p>")
        else:
            diff = (f"<p>{html.escape(s.folder)}/stage.toml names no lesson pairs "
                    f"(<code>lesson = [[before, after]]</code>).</p>")
        parts = [f'<p class="crumb">Stage {s.number} · <code>stages/{s.folder}</code> · '
                 f"<code>make stage {s.number}</code></p>",
                 f'<section class="lesson">{lesson}</section>',
                 f'<h2 id="the-lesson-as-a-diff">The lesson as a diff: <code>make diff {s.number}'
                 f"</code></h2>", f'<section class="lesson-diff">{diff}</section>']
        if notebook:
            parts += [f'<h2 id="the-notebook">The notebook, executed: '
                      f"<code>notebooks/{notebook.name}</code></h2>",
                      self.notebook_section(notebook)]
        else:
            parts.append(f"<p>Stage {s.number} has no notebook in notebooks/.</p>")
        return "\n".join(parts)

    def exercises_page(self) -> str:
        parts = ["<h1 id=\"exercises\">Exercises</h1>",
                 "<p>Each exercise is a marked region of a stage's own source. <code>make exercise "
                 "N</code> copies stage N to <code>exercises/NN_name/</code> with the regions cut "
                 "out; <code>make verify N</code> builds your copy and runs the stage's tests on "
                 "it. Exercises in CUDA files ([GPU]) run on a GPU; elsewhere their tests are "
                 "skipped.</p>"]
        for s in self.stages:
            found = exercises.find(s)
            if not found:
                continue
            rows = "".join(
                f"<tr><td><code>{html.escape(e.name)}</code>{' [GPU]' if e.gpu_only else ''}</td>"
                f"<td><code>{html.escape(e.where)}</code></td><td>{html.escape(e.task)}</td>"
                f"<td>{'<br>'.join(html.escape(t) for t in e.checked_by)}</td></tr>" for e in found)
            parts.append(f'<h2 id="stage-{s.number}"><a href="{s.folder}.html">Stage {s.number}'
                         f"</a>: <code>make exercise {s.number}</code></h2>"
                         f'<table class="exercises"><tr><th>exercise</th><th>where</th>'
                         f"<th>what to write</th><th>checked by</th></tr>{rows}</table>")
        return "\n".join(parts)

    def bench_page(self) -> str:
        results = REPO / "bench" / "results"
        parts = ['<h1 id="benchmark-results">Benchmark results</h1>',
                 "<p>What <code>make bench</code> measured, as committed in "
                 "<code>bench/results/</code>: each machine's table (medians, validated against "
                 "the float64 reference before timing) and its plot.</p>"]
        ops = sorted(p for p in results.iterdir() if p.is_dir()) if results.is_dir() else []
        for op in ops:
            parts.append(f'<h2 id="{slug(op.name)}" class="op">{html.escape(op.name)}</h2>')
            for md in sorted(op.glob("*.md")):
                text = md.read_text()
                parts.append(f'<section class="bench" data-source="{rel(md)}">'
                             f"{markdown(text, Links(self, op))}</section>")
            shown = set(re.findall(r"\(([^)\s]+\.png)\)", "".join(
                md.read_text() for md in op.glob("*.md"))))
            for png in sorted(op.glob("*.png")):
                if png.name not in shown:
                    parts.append(f'<p><img src="{self.copy_file(png)}" alt="{png.name}"></p>')
        if not ops:
            parts.append("<p>No results in bench/results/ yet: <code>make bench</code>.</p>")
        return "\n".join(parts)

    def build(self) -> None:
        from pygments.formatters import HtmlFormatter

        if self.out.exists():
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        self.write("assets/book.css", (THEME / "book.css").read_text())
        self.write("assets/pygments.css", HtmlFormatter(style="default").get_style_defs(".hl"))
        for info in self.pages:
            start = time.perf_counter()
            if info.file == "index.html":
                body = self.start_page()
            elif info.group == "Stages":
                s = next(s for s in self.stages if f"{s.folder}.html" == info.file)
                body = self.stage_page(s, info.notebook)
            elif info.group == "Appendices":
                body = (f'<p class="crumb">Appendix · <code>notebooks/{info.notebook.name}</code>'
                        f"</p>{self.notebook_section(info.notebook)}")
            elif info.file == "exercises.html":
                body = self.exercises_page()
            else:
                body = self.bench_page()
            self.page(info, body)
            log(f"{info.file:<28} {time.perf_counter() - start:5.2f} s")


# ----------------------------------------------------------------------------------------------
# The check: every page there, every picture, every internal link


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []  # (tag, attribute, value)
        self.ids: set[str] = set()
        self.pictures: dict[str, int] = {}  # notebook -> <img class="nb-picture"> inside it
        self.expected: dict[str, int] = {}  # notebook -> data-pictures
        self._section: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        for name in ("href", "src"):
            if attrs.get(name) is not None:
                self.refs.append((tag, name, attrs[name]))
        if tag == "section" and "data-notebook" in attrs:
            self._section = attrs["data-notebook"]
            self.pictures.setdefault(self._section, 0)
            self.expected[self._section] = int(attrs.get("data-pictures", -1))
        if tag == "img" and "nb-picture" in (attrs.get("class") or "").split() and self._section:
            self.pictures[self._section] += 1


def check(out: Path, executed_dir: Path) -> list[str]:
    """What is wrong with the book in `out` (an empty list: nothing). The pages expected are
    found from the repository (stages, notebooks), the pictures counted in the executed
    notebooks, the links followed on disk."""
    problems: list[str] = []
    if not (out / "index.html").is_file():
        return [f"{out / 'index.html'} is missing: run make book"]
    parsed: dict[Path, _Tags] = {}
    for page in sorted(out.glob("*.html")):
        tags = _Tags()
        tags.feed(page.read_text())
        parsed[page.resolve()] = tags
    expected_pages = {"index.html", "exercises.html", "bench.html"}
    expected_pages |= {f"{s.folder}.html" for s in stages.all_stages()}
    expected_pages |= {f"{nb.stem}.html" for nb in appendices()}
    for name in sorted(expected_pages):
        if not (out / name).is_file():
            problems.append(f"page {name} is missing")
    start = parsed[(out / "index.html").resolve()]
    linked = {urlsplit(v).path for _, _, v in start.refs}
    for s in stages.all_stages():
        if f"{s.folder}.html" not in linked:
            problems.append(f"index.html does not link to stage {s.number}'s page {s.folder}.html")
    # Every notebook is shown on some page, with as many pictures as its executed copy holds.
    shown: dict[str, int] = {}
    for tags in parsed.values():
        for nb, count in tags.pictures.items():
            shown[nb] = shown.get(nb, 0) + count
    for nb in find_notebooks():
        if nb.name not in shown:
            problems.append(f"no page shows notebooks/{nb.name}")
            continue
        executed = executed_dir / nb.name
        if not executed.is_file():
            problems.append(f"no executed copy {executed} to count the pictures of {nb.name}")
            continue
        want = count_images(json.loads(executed.read_text()))
        if shown[nb.name] != want:
            problems.append(f"{nb.name}: the book shows {shown[nb.name]} pictures, the executed "
                            f"notebook holds {want}")
    # Every reference resolves: files exist, fragments name an id of their page; nothing loaded
    # from the network.
    for page, tags in parsed.items():
        name = page.relative_to(out.resolve()).as_posix()
        for tag, attr, value in tags.refs:
            parts = urlsplit(value)
            if parts.scheme in ("http", "https") or value.startswith("//"):
                if tag != "a":
                    problems.append(f"{name}: <{tag} {attr}> loads {value} from the network")
                continue
            if parts.scheme in ("mailto", "data"):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if not target.exists():
                problems.append(f"{name}: <{tag} {attr}=\"{value}\"> points at a missing file")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else None
                if ids is not None and parts.fragment not in ids:
                    problems.append(f"{name}: link {value}: no id {parts.fragment!r} there")
    return problems


def report(problems: list[str], out: Path) -> int:
    if problems:
        print(f"[book] check FAILED, {len(problems)} problem(s) in {out}:")
        for p in problems:
            print(f"  - {p}")
        return 1
    pages = len(list(out.glob("*.html")))
    images = len(list(out.rglob("*.png"))) + len(list(out.rglob("*.svg")))
    log(f"check ok: {pages} pages, {images} images, every page, picture and internal link "
        f"there")
    return 0


def size_of(folder: Path) -> str:
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return f"{total / 1e6:.1f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="default: build/book")
    parser.add_argument("--executed", type=Path, default=None,
                        help="the executed notebooks (default: build/notebooks)")
    parser.add_argument("--reuse", action="store_true",
                        help="use the executed copies as they are, even when stale")
    parser.add_argument("--check", action="store_true", help="only check an existing book")
    args = parser.parse_args(argv)
    out = (args.out or build_root() / "book").resolve()
    executed_dir = (args.executed or build_root() / "notebooks").resolve()
    if args.check:
        return report(check(out, executed_dir), out)
    try:
        import mistune  # noqa: F401
        import pygments  # noqa: F401
    except ImportError as error:
        print(f"[book] {error.name} is missing: pip install -r requirements-book.txt "
              f"(make book does)")
        return 2
    start = time.perf_counter()
    try:
        notebooks = find_notebooks()
        copies = executed_copies(notebooks, executed_dir, args.reuse)
        book = Book(out, executed_dir)
        log("reading the machine the notebooks ran on (imports torch) ...")
        book.footer = machine_facts(list(copies.values()))
        log(book.footer)
        log(f"writing {len(book.pages)} pages to {out}")
        book.build()
    except (BookError, stages.StageError, exercises.ExerciseError) as error:
        print(f"[book] {error}")
        return 1
    status = report(check(out, executed_dir), out)
    log(f"{out / 'index.html'} ({size_of(out)}) in {time.perf_counter() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
