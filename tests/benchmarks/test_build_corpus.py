"""benchmarks/corpus/build_corpus.py: HTML to prose, document names whose sorted tail is the held-out set, and a
reproducible archive (no network: the Debian download is not exercised here)."""

import os

import pytest

from loco_lab.data import ByteCorpus

PAGE = """<html><head><title>Ignored title</title><script>var x = 1;</script></head>
<body><nav role="navigation"><a href="index.html">Home</a> | <a href="next.html">Next</a></nav>
<div class="sphinxsidebar">Quick search</div>
<div class="body" role="main">
  <h1>Built-in   Functions<a class="headerlink" href="#f">\xb6</a></h1>
  <p>The interpreter has
     a number of <code>functions</code> built in.</p>
  <div class="highlight"><pre>print("code is dropped")</pre></div>
  <ul><li>abs(x)</li><li>all(iterable)<br>returns &amp; tests</li></ul>
</div>
<div class="footer">Copyright 2001</div></body></html>"""


@pytest.fixture(scope="module")
def corpus(benchmark_module):
    return benchmark_module("corpus/build_corpus")


def test_html_to_text_keeps_the_content_blocks_only(corpus):
    assert corpus.html_to_text(PAGE) == ("Built-in Functions\n\nThe interpreter has a number of functions built in."
                                         "\n\nabs(x)\n\nall(iterable)\n\nreturns & tests\n")


def test_html_to_text_without_a_content_element_keeps_the_body(corpus):
    page = "<body><nav>Menu</nav><p>One  para.</p><table><tr><td>cell</td></tr></table></body>"
    assert corpus.html_to_text(page) == "One para.\n\ncell\n"
    assert corpus.html_to_text("<div><script>x</script></div>") == ""


def test_names_sort_by_hash_and_fit_a_ustar_header(corpus):
    pages = [f"library/{'deep/' * 30}page{i}.html" for i in range(40)]
    names = [corpus.document_name("python3.11-doc", p) for p in pages]
    assert names == [corpus.document_name("python3.11-doc", p) for p in pages]
    assert len(set(names)) == len(names) and all(len(n) <= 100 for n in names)
    digests = [n.split("_")[0] for n in names]
    assert sorted(names) == [n for _, n in sorted(zip(digests, names))]
    assert corpus.document_name("a", "x.html") != corpus.document_name("b", "x.html")


def test_held_out_is_the_split_that_from_path_reads(corpus, tmp_path):
    docs = {corpus.document_name(pkg, f"p{i}.html"): f"{pkg} document {i}. " * 20
            for pkg in ("alpha", "beta") for i in range(10)}
    corpus.write(docs, str(tmp_path))
    held = corpus.held_out(docs)
    assert len(held) == 2 and held == sorted(docs)[-2:]
    loaded = ByteCorpus.from_path(str(tmp_path), seq_len=16)
    assert list(loaded.validation_plays) == held
    assert set(loaded.train_plays) == set(docs) - set(held)
    with pytest.raises(FileExistsError, match="already holds .txt files"):
        corpus.write(docs, str(tmp_path))


def test_documents_skip_indexes_code_pages_and_stubs(corpus, tmp_path):
    long_page = PAGE.replace("built in.", "built in. " + "More prose. " * 100)
    for rel, text in (("a.html", long_page), ("stub.html", PAGE), ("genindex.html", long_page),
                      ("_modules/m.html", long_page), ("sub/b.html", long_page), ("print.html", long_page),
                      ("c.txt", long_page)):
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_text(text)
    docs = corpus.documents("pkg", str(tmp_path))
    assert sorted(docs) == sorted(corpus.document_name("pkg", p) for p in ("a.html", os.path.join("sub", "b.html")))
    assert corpus.deduplicate(docs) == {min(docs): docs[min(docs)]}
    assert list(corpus.documents("pkg", str(tmp_path), folders=("sub", ))) == [corpus.document_name("pkg", "sub/b.html")]


def test_archive_is_reproducible_and_unpacks_to_the_same_files(corpus, tmp_path):
    docs = {corpus.document_name("pkg", f"p{i}.html"): f"text {i}\n" * (i + 1) for i in range(5)}
    corpus.write(docs, str(tmp_path / "folder"))
    corpus.archive(str(tmp_path / "folder"), str(tmp_path / "one.tar.xz"))
    os.utime(tmp_path / "folder" / min(docs), (1, 1))
    corpus.archive(str(tmp_path / "folder"), str(tmp_path / "two.tar.xz"))
    assert (tmp_path / "one.tar.xz").read_bytes() == (tmp_path / "two.tar.xz").read_bytes()
    corpus.unpack(str(tmp_path / "one.tar.xz"), str(tmp_path / "back"))
    assert {n: (tmp_path / "back" / n).read_text() for n in os.listdir(tmp_path / "back")} == docs


# The default set as the running study built it (benchmarks/corpus/README.md): package, HTML folder, subfolders.
DEFAULT_SET = (
    ("python3.11-doc", "usr/share/doc/python3.11/html", ()),
    ("python-django-doc", "usr/share/doc/python-django-doc/html", ()),
    ("python-sqlalchemy-doc", "usr/share/doc/python-sqlalchemy-doc/html", ()),
    ("python-scipy-doc", "usr/share/doc/python-scipy-doc/html", ()),
    ("postgresql-doc-15", "usr/share/doc/postgresql-doc-15/html", ()),
    ("python-pandas-doc", "usr/share/doc/python-pandas-doc/html", ()),
    ("python-sklearn-doc", "usr/share/doc/python-sklearn-doc/html", ()),
    ("python-sympy-doc", "usr/share/doc/python-sympy-doc/html", ()),
    ("python-astropy-doc", "usr/share/doc/python-astropy-doc/html", ()),
    ("sqlite3-doc", "usr/share/doc/sqlite3", ()),
    ("erlang-doc", "usr/share/doc/erlang-doc", ()),
    ("nodejs-doc", "usr/share/doc/nodejs/api", ()),
    ("rust-doc", "usr/share/doc/rust-doc/html", ("book", "reference", "nomicon", "rust-by-example", "edition-guide",
                                                 "embedded-book", "rustc", "rustdoc", "unstable-book")),
    ("python-statsmodels-doc", "usr/share/doc/python-statsmodels-doc/html", ()),
    ("python-dask-doc", "usr/share/doc/python-dask-doc/html", ()),
    ("cmake-doc", "usr/share/doc/cmake-data/html", ()),
    ("python-celery-doc", "usr/share/doc/python-celery-doc/html", ()),
)


def test_default_set_is_unchanged_and_xl_extends_it(corpus):
    assert tuple((s.package, s.html_root, s.folders) for s in corpus.SOURCES) == DEFAULT_SET
    assert corpus.SETS == {"default": corpus.SOURCES, "xl": corpus.XL_SOURCES}
    assert corpus.OUT_FOLDERS == {"default": ".corpus_large", "xl": ".corpus_xl"}
    assert corpus.XL_SOURCES[:len(corpus.SOURCES)] == corpus.SOURCES and len(corpus.XL_SOURCES) > len(corpus.SOURCES)
    packages = [s.package for s in corpus.XL_SOURCES]
    assert len(set(packages)) == len(packages)  # build's summary is by package
    assert all(s.licence and not s.html_root.startswith("/") for s in corpus.XL_SOURCES)


def test_set_option_picks_the_packages_and_the_folder(corpus, tmp_path, monkeypatch):
    calls = []

    def fake_build(out, workdir, sources):
        calls.append((out, sources))
        corpus.write({corpus.document_name("pkg", "p.html"): "text\n"}, out)
        return {"pkg": ("1.0", 1, 5)}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(corpus, "build", fake_build)
    corpus.main([])
    corpus.main(["--set", "xl"])
    corpus.main(["--set", "xl", "--out", "elsewhere"])
    assert calls == [(".corpus_large", corpus.SOURCES), (".corpus_xl", corpus.XL_SOURCES),
                     ("elsewhere", corpus.XL_SOURCES)]


def test_set_option_refuses_an_unknown_set_naming_the_valid_ones(corpus, capsys):
    with pytest.raises(SystemExit):
        corpus.main(["--set", "huge"])
    error = capsys.readouterr().err
    assert "--set" in error and "'huge'" in error and "'default'" in error and "'xl'" in error
    with pytest.raises(SystemExit):
        corpus.main(["--help"])
    assert "--set {default,xl}" in capsys.readouterr().out



def test_html_to_text_drops_doxygens_title_area(corpus):
    doxygen = ('<body><div id="top"><div id="titlearea"><table><tr><td><div id="projectname">OpenCV</div>'
               '<div id="projectbrief">Open Source Computer Vision</div></td></tr></table></div></div>'
               '<div class="contents"><p>n-dimensional dense array class</p></div></body>')
    assert corpus.html_to_text(doxygen) == "n-dimensional dense array class\n"
