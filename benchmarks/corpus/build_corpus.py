"""Build a large English text corpus (about 75 MB) from Debian 12 documentation packages, offline from the
packages, for byte-level language-model training at large batch (issue 39, item 3).

Writes a folder of ``*.txt`` files, one per source document, that ``loco_lab.data.ByteCorpus.from_path`` reads.
Every file is named ``<h>_<package>_<page>.txt`` where ``h`` is the first 12 hex digits of the sha256 of
``<package>/<page path>``, so sorting by name sorts by that hash, and the held-out tail that ``from_path`` takes
(the last 10% of files by name) is the 10% of whole documents with the largest hashes, a fixed pseudo-random
choice across all packages. See benchmarks/corpus/README.md for the sources, licences and sizes.

    python3 benchmarks/corpus/build_corpus.py --out .corpus_large --archive .corpus_large.tar.xz
    python3 benchmarks/corpus/build_corpus.py --unpack .corpus_large.tar.xz --out .corpus_large

``--set xl`` builds the opt-in larger corpus instead (the default packages and those of ``XL_SOURCES``):

    python3 benchmarks/corpus/build_corpus.py --set xl --out .corpus_xl --archive .corpus_xl.tar.xz
"""

import argparse
import hashlib
import html.parser
import io
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from typing import Dict, Iterable, List, NamedTuple, Tuple


class Source(NamedTuple):
    """A Debian package, the folder inside it of the HTML pages taken, and (if not all) the subfolders taken."""
    package: str
    html_root: str
    licence: str
    folders: Tuple[str, ...] = ()


SOURCES = (
    Source("python3.11-doc", "usr/share/doc/python3.11/html", "PSF-2.0"),
    Source("python-django-doc", "usr/share/doc/python-django-doc/html", "BSD-3-Clause"),
    Source("python-sqlalchemy-doc", "usr/share/doc/python-sqlalchemy-doc/html", "MIT"),
    Source("python-scipy-doc", "usr/share/doc/python-scipy-doc/html", "BSD-3-Clause"),
    Source("postgresql-doc-15", "usr/share/doc/postgresql-doc-15/html", "PostgreSQL"),
    Source("python-pandas-doc", "usr/share/doc/python-pandas-doc/html", "BSD-3-Clause"),
    Source("python-sklearn-doc", "usr/share/doc/python-sklearn-doc/html", "BSD-3-Clause"),
    Source("python-sympy-doc", "usr/share/doc/python-sympy-doc/html", "BSD-3-Clause"),
    Source("python-astropy-doc", "usr/share/doc/python-astropy-doc/html", "BSD-3-Clause"),
    Source("sqlite3-doc", "usr/share/doc/sqlite3", "public-domain"),
    Source("erlang-doc", "usr/share/doc/erlang-doc", "Apache-2.0"),
    Source("nodejs-doc", "usr/share/doc/nodejs/api", "Expat"),
    Source("rust-doc", "usr/share/doc/rust-doc/html", "MIT or Apache-2.0",
           ("book", "reference", "nomicon", "rust-by-example", "edition-guide", "embedded-book", "rustc", "rustdoc",
            "unstable-book")),
    Source("python-statsmodels-doc", "usr/share/doc/python-statsmodels-doc/html", "BSD-3-Clause"),
    Source("python-dask-doc", "usr/share/doc/python-dask-doc/html", "BSD-3-Clause"),
    Source("cmake-doc", "usr/share/doc/cmake-data/html", "BSD-3-Clause"),
    Source("python-celery-doc", "usr/share/doc/python-celery-doc/html", "BSD-2-Clause"),
)

# The opt-in larger corpus (--set xl): the default packages and these, chosen from Debian 12 ``main`` for a
# permissive or public-domain licence and at least 0.5 MB of text of which at least a quarter is prose-like blocks
# and at most 55% is blocks repeated elsewhere in the package (benchmarks/corpus/README.md, "The xl set").
XL_SOURCES = SOURCES + (
    Source("libboost1.81-doc", "usr/share/doc/libboost1.81-doc/doc", "BSL-1.0"),
    Source("llvm-16-doc", "usr/share/doc/llvm-16-doc/html", "Apache-2.0 WITH LLVM-exception"),
    Source("clang-16-doc", "usr/share/doc/clang-16/html", "Apache-2.0 WITH LLVM-exception"),
    Source("apache2-doc", "usr/share/doc/apache2-doc/manual", "Apache-2.0", ("en",)),
    Source("dpdk-doc", "usr/share/doc/dpdk", "BSD-3-Clause", ("guides",)),
    Source("swi-prolog-doc", "usr/share/swi-prolog/doc", "BSD-2-Clause"),
    Source("nim-doc", "usr/share/doc/nim/html", "Expat"),
    Source("zsh-doc", "usr/share/doc/zsh-common/html", "Zsh"),
    Source("ghc-doc", "usr/share/doc/ghc-doc/html", "BSD-3-Clause", ("users_guide", "haddock")),
    Source("tomcat10-docs", "usr/share/tomcat10-docs/docs", "Apache-2.0"),
    Source("ant-doc", "usr/share/doc/ant", "Apache-2.0", ("manual",)),
    Source("varnish-doc", "usr/share/doc/varnish/html", "BSD-2-Clause"),
    Source("netcdf-doc", "usr/share/doc/netCDF/html", "BSD-3-Clause"),
    Source("docutils-doc", "usr/share/doc/docutils-doc", "public-domain"),
    Source("sphinx-doc", "usr/share/doc/sphinx-doc/html", "BSD-2-Clause"),
    Source("pypy3-doc", "usr/share/doc/pypy3/html", "Expat"),
    Source("python-ipython-doc", "usr/share/doc/python-ipython-doc/html", "BSD-3-Clause"),
    Source("python-lxml-doc", "usr/share/doc/python-lxml/html", "BSD-3-Clause"),
    Source("python-skimage-doc", "usr/share/doc/python-skimage-doc/html", "BSD-3-Clause"),
    Source("python-sfepy-doc", "usr/share/doc/python-sfepy-doc/html", "BSD-3-Clause"),
    Source("python-pyfai-doc", "usr/share/doc/python-pyfai-doc/html", "Expat"),
    Source("sasview-doc", "usr/share/doc/sasview/html", "BSD-3-Clause"),
    Source("python-pytest-doc", "usr/share/doc/python-pytest-doc/html", "Expat"),
    Source("python-setuptools-doc", "usr/share/doc/python-setuptools-doc/html", "MIT"),
    Source("python-flask-doc", "usr/share/doc/python-flask-doc/html", "BSD-3-Clause"),
    Source("python-tables-doc", "usr/share/doc/python-tables-doc/html", "BSD-3-Clause"),
    Source("python-gevent-doc", "usr/share/doc/python-gevent-doc/html", "MIT"),
    Source("python-pymongo-doc", "usr/share/doc/python-pymongo-doc/html", "Apache-2.0"),
    Source("scons-doc", "usr/share/doc/scons/HTML", "Expat"),
    Source("nova-doc", "usr/share/doc/nova-doc/html", "Apache-2.0"),
    Source("neutron-doc", "usr/share/doc/neutron-doc/html", "Apache-2.0"),
    Source("cinder-doc", "usr/share/doc/cinder-doc/html", "Apache-2.0"),
    Source("glance-doc", "usr/share/doc/glance-doc/html", "Apache-2.0"),
    Source("heat-doc", "usr/share/doc/heat-doc/html", "Apache-2.0"),
    Source("ironic-doc", "usr/share/doc/ironic-doc/html", "Apache-2.0"),
    Source("keystone-doc", "usr/share/doc/keystone-doc/html", "Apache-2.0"),
    Source("octavia-doc", "usr/share/doc/octavia-doc/html", "Apache-2.0"),
    Source("manila-doc", "usr/share/doc/manila-doc/html", "Apache-2.0"),
    Source("swift-doc", "usr/share/doc/swift-doc", "Apache-2.0"),
    Source("python-openstacksdk-doc", "usr/share/doc/python-openstacksdk-doc/html", "Apache-2.0"),
    Source("twisted-doc", "usr/share/doc/twisted-doc/html", "Expat",
           ("core", "web", "conch", "mail", "names", "pair", "words", "historic", "installation")),
    Source("opencv-doc", "usr/share/doc/opencv-doc/opencv4/html", "Apache-2.0 AND BSD-3-Clause"),
)
# The corpus sets by --set name, and the folder each is written to unless --out says otherwise.
SETS = {"default": SOURCES, "xl": XL_SOURCES}
OUT_FOLDERS = {"default": ".corpus_large", "xl": ".corpus_xl"}

# Pages that are not prose: highlighted source code, indexes, search, and static assets.
SKIPPED_DIRS = ("_modules", "_static", "_images", "_sources", "_downloads")
SKIPPED_PAGES = ("genindex", "search.html", "py-modindex.html", "np-modindex.html", "bookindex.html",
                 "print.html")
# Documents with less extracted text than this (bytes) are tables of contents or stubs, not prose.
MIN_DOCUMENT_BYTES = 1000

BLOCK_TAGS = {"p", "div", "section", "article", "main", "li", "ul", "ol", "dl", "dt", "dd", "table", "tr", "br",
              "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "title", "caption", "figcaption", "hr", "td", "th"}
# Subtrees never kept: scripts, navigation, and code listings (prose over code).
DROPPED_TAGS = {"script", "style", "head", "nav", "header", "footer", "pre", "button", "form", "noscript", "svg"}
# Class or id words marking navigation or decoration in Sphinx, pydata, DocBook and (xl set) Doxygen pages.
DROPPED_MARKS = {"headerlink", "sphinxsidebar", "related", "footer", "navheader", "navfooter", "highlight",
                 "prev-next-area", "prev-next-info", "toc", "bd-toc", "sidebar", "nav", "breadcrumb",
                 "docs-navigation-links", "searchbox", "version_switcher_placeholder", "toc-backref",
                 "language_switcher_placeholder", "line-block", "titlearea"}
# Where a page's content lives, in the order tried; a page with none of them keeps its whole <body>.
CONTENT_MARKS = (("role", "main"), ("id", "docs-body"), ("id", "yui-main"))
SLUG_CHARS = 50
VOID_TAGS = {"br", "hr", "img", "input", "meta", "link", "wbr", "col", "area", "base", "source"}


class _TextExtractor(html.parser.HTMLParser):
    """Collects the text of an HTML page's content element (or whole page), dropping navigation and code."""

    def __init__(self, content_mark: Tuple[str, str]):
        super().__init__(convert_charrefs=True)
        self.content_mark = content_mark
        self.stack: List[Tuple[str, bool, bool]] = []  # (tag, dropped subtree, content root)
        self.depth_dropped = 0
        self.in_content = content_mark is None
        self.found_content = False
        self.parts: List[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        words = set((attrs.get("class") or "").split()) | {attrs.get("id") or ""}
        dropped = tag in DROPPED_TAGS or bool(words & DROPPED_MARKS) or attrs.get("role") == "navigation"
        root = (not self.in_content and self.content_mark is not None
                and attrs.get(self.content_mark[0]) == self.content_mark[1])
        if root:
            self.in_content = self.found_content = True
        if tag in BLOCK_TAGS:
            self.parts.append("\n")
        if tag in VOID_TAGS:
            return
        self.stack.append((tag, dropped, root))
        self.depth_dropped += dropped

    def handle_endtag(self, tag):
        if tag in VOID_TAGS or not any(t == tag for t, _, _ in self.stack):
            return
        while self.stack:
            open_tag, dropped, root = self.stack.pop()
            self.depth_dropped -= dropped
            if root:
                self.in_content = False
            if open_tag == tag:
                break
        if tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data):
        if self.in_content and not self.depth_dropped:
            self.parts.append(re.sub(r"\s+", " ", data))


def html_to_text(page: str) -> str:
    """The prose of an HTML page as plain text: the content element's text (the first of ``CONTENT_MARKS``
    present, else the whole page) without scripts, navigation or code listings; each block (paragraph, heading,
    list item, cell) on one line with its white space collapsed, a blank line between blocks, ending in one
    newline ('' for a page without text)."""
    mark = next((m for m in CONTENT_MARKS if re.search(rf'{m[0]}="{re.escape(m[1])}"', page)), None)
    parser = _TextExtractor(mark)
    parser.feed(page)
    parser.close()
    blocks = (" ".join(block.split()) for block in "".join(parser.parts).replace("\xb6", "").split("\n"))
    text = "\n\n".join(block for block in blocks if block)
    return text + "\n" if text else ""


def document_name(package: str, page: str) -> str:
    """The file name of ``page`` (a path inside the package's HTML folder) of ``package``: the sha256 of
    ``package/page`` (12 hex digits) first, so that sorting names orders documents by that hash; the page's
    path follows, shortened to its last ``SLUG_CHARS`` characters so that a name fits a ustar header."""
    digest = hashlib.sha256(f"{package}/{page}".encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9.-]+", "-", page[:-len(".html")] if page.endswith(".html") else page)
    return f"{digest}_{package}_{slug[-SLUG_CHARS:]}.txt"


def held_out(names: Iterable[str], validation_share: float = 0.1) -> List[str]:
    """The documents that ``ByteCorpus.from_path`` holds out of a folder of these ``names``: the last
    ``validation_share`` of them by name (at least one), here the documents of largest hash."""
    names = sorted(names)
    return names[len(names) - max(1, round(validation_share * len(names))):]


def pages(root: str, folders: Tuple[str, ...] = ()) -> List[str]:
    """The HTML pages under ``root`` (only under its subfolders ``folders`` if given) taken as documents (paths
    relative to ``root``, sorted)."""
    found = []
    for top in [os.path.join(root, f) for f in folders] or [root]:
        found += _pages_under(top, root)
    return sorted(found)


def _pages_under(top: str, root: str) -> List[str]:
    found = []
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in files:
            if name.endswith(".html") and not name.startswith(SKIPPED_PAGES):
                found.append(os.path.relpath(os.path.join(folder, name), root))
    return found


def documents(package: str, root: str, folders: Tuple[str, ...] = ()) -> Dict[str, str]:
    """``{file name: text}`` for the pages of ``package`` extracted under ``root`` (:func:`pages`) with enough
    prose."""
    out = {}
    for page in pages(root, folders):
        with open(os.path.join(root, page), encoding="utf-8", errors="replace") as f:
            text = html_to_text(f.read())
        if len(text.encode()) >= MIN_DOCUMENT_BYTES:
            out[document_name(package, page)] = text
    return out


def deduplicate(docs: Dict[str, str]) -> Dict[str, str]:
    """``docs`` with each identical text kept once, under its first name in sorted order."""
    seen, out = set(), {}
    for name in sorted(docs):
        if docs[name] not in seen:
            seen.add(docs[name])
            out[name] = docs[name]
    return out


def fetch(source: Source, workdir: str) -> Tuple[str, str]:
    """Download ``source``'s .deb with ``apt-get download`` and unpack it with ``dpkg -x`` into ``workdir``;
    returns (its HTML folder, the package version)."""
    subprocess.run(["apt-get", "download", source.package], cwd=workdir, check=True, stdout=subprocess.DEVNULL)
    deb = next(f for f in sorted(os.listdir(workdir)) if f.startswith(source.package + "_") and f.endswith(".deb"))
    version = subprocess.run(["dpkg-deb", "-f", deb, "Version"], cwd=workdir, check=True, capture_output=True,
                             text=True).stdout.strip()
    target = os.path.join(workdir, source.package)
    subprocess.run(["dpkg", "-x", deb, target], cwd=workdir, check=True)
    root = os.path.join(target, source.html_root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"package {source.package} {version}: no HTML folder {source.html_root}")
    return root, version


def write(docs: Dict[str, str], out: str) -> None:
    """Write ``docs`` as UTF-8 files into the new folder ``out`` (refuses a folder that holds .txt files)."""
    os.makedirs(out, exist_ok=True)
    if any(f.endswith(".txt") for f in os.listdir(out)):
        raise FileExistsError(f"--out {out} already holds .txt files: remove it or choose another folder")
    for name in sorted(docs):
        with open(os.path.join(out, name), "w", encoding="utf-8", newline="\n") as f:
            f.write(docs[name])


def archive(folder: str, path: str) -> None:
    """A byte-reproducible ``.tar.xz`` of the ``*.txt`` files of ``folder`` (sorted, zero times and owners)."""
    with lzma.open(path, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(f for f in os.listdir(folder) if f.endswith(".txt")):
            data = open(os.path.join(folder, name), "rb").read()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))


def unpack(path: str, out: str) -> None:
    """Extract the archive ``path`` (as written by :func:`archive`) into ``out``."""
    os.makedirs(out, exist_ok=True)
    with tarfile.open(path, "r:xz") as tar:
        tar.extractall(out, filter="data")


def build(out: str, workdir: str, sources: Tuple[Source, ...] = SOURCES) -> Dict[str, Tuple[str, int, int]]:
    """Fetch every source of ``sources``, extract, deduplicate and write the corpus to ``out``;
    returns ``{package: (version, documents kept, bytes kept)}``."""
    docs, versions = {}, {}
    for source in sources:
        root, versions[source.package] = fetch(source, workdir)
        docs.update(documents(source.package, root, source.folders))
    docs = deduplicate(docs)
    write(docs, out)
    summary = {}
    for source in sources:
        mine = [t for n, t in docs.items() if n.split("_", 2)[1] == source.package]
        summary[source.package] = (versions[source.package], len(mine), sum(len(t.encode()) for t in mine))
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="default", choices=tuple(SETS),
                        help="which corpus: 'default' (17 packages, about 75 MB, the study's) or 'xl' (those and "
                             f"{len(XL_SOURCES) - len(SOURCES)} more, benchmarks/corpus/README.md); default: default")
    parser.add_argument("--out", help="folder to write the .txt documents to (default: the set's, "
                                      + ", ".join(f"{s}: {f}" for s, f in OUT_FOLDERS.items()) + ")")
    parser.add_argument("--archive", help="also write the folder as this .tar.xz")
    parser.add_argument("--unpack", metavar="ARCHIVE", help="only extract ARCHIVE into --out")
    args = parser.parse_args(argv)
    args.out = args.out or OUT_FOLDERS[args.set]
    if args.unpack:
        unpack(args.unpack, args.out)
        return
    with tempfile.TemporaryDirectory() as workdir:
        summary = build(args.out, workdir, SETS[args.set])
    for package, (version, count, size) in summary.items():
        print(f"{package} {version}: {count} documents, {size} bytes")
    names = sorted(f for f in os.listdir(args.out) if f.endswith(".txt"))
    held = held_out(names)
    size = lambda group: sum(os.path.getsize(os.path.join(args.out, f)) for f in group)  # noqa: E731
    print(f"{len(names)} documents, {size(names)} bytes; held out {len(held)} documents, {size(held)} bytes")
    if args.archive:
        archive(args.out, args.archive)
        digest = hashlib.sha256(open(args.archive, "rb").read()).hexdigest()
        print(f"{args.archive}: {os.path.getsize(args.archive)} bytes, sha256 {digest}")


if __name__ == "__main__":
    sys.exit(main())
