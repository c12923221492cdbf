"""The documentation site, built as the README says, with warnings as errors: a broken
cross-reference or internal link, or a cell that raises where it should not, fails it.

It is built as a docs host builds it: the wheel installed into a fresh environment, then
Sphinx from the checkout, with the installed package documented (never the checkout's
folder, where magics/ is not notebook_dist.magics). The tutorials come in as the tutorial
tests executed them (tests/test_notebooks.py leaves
them in the ``executed_notebooks`` folder); the hang catalogue and the troubleshooting page
run at build time. Then the pages are checked, and a tutorial's dashboard record is looked
at in Chromium, with no kernel.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from installs import REPO, clean_env, fresh_venv, pip, purelib

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the build comes first
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TUTORIALS = sorted(p.stem for p in (REPO / "notebooks").glob("*.ipynb"))


def text_of(page: Path) -> str:
    """What a reader sees of a page: its text, without tags or entities."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


@pytest.fixture(scope="module")
def docs_python(tmp_path_factory, built) -> Path:
    """A fresh venv with the built wheel installed, as a docs host installs the package (a
    regular install: only it maps magics/ to notebook_dist.magics, so a build that imported
    the checkout's folder instead would fail)."""
    where = tmp_path_factory.mktemp("docs-venv")
    py = fresh_venv(where)
    pip("--python", str(py), "install", "-q", "--no-deps", str(built["wheel"]), cwd=where)
    return py


@pytest.fixture(scope="module")
def site(tmp_path_factory, executed_notebooks, docs_python) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(
        clean_env(out, docs_python),
        NOTEBOOK_DIST_EXECUTED=str(executed_notebooks),
        JUPYTER_PATH=str(out / "jupyter"),
    )
    build = subprocess.run(  # from the checkout, where its folder comes first on sys.path
        [
            str(docs_python),
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-b",
            "html",
            "-d",
            str(out / "doctrees"),
            "docs",
            str(out / "html"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-6000:]
    return out / "html"


def test_the_site_builds_with_warnings_as_errors(site):
    for page in (
        "index",
        "guide",
        "benchmarks",
        "hangs",
        "troubleshooting",
        "beyond",
        "reference/magics",
        "reference/api",
    ):
        assert (site / f"{page}.html").exists(), page
    index = text_of(site / "index.html")
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"```bash\n(python3 -m venv .+?)\n```", readme)
    assert len(commands) == 2
    for command in commands:
        assert command in index  # the two set-up commands, from the README
    assert "images/dashboard.png" in (site / "index.html").read_text()


def test_every_tutorial_is_rendered_with_its_outputs(site):
    for name in TUTORIALS:
        page = (site / "tutorials" / f"{name}.html").read_text()
        assert "cell_output" in page, f"{name} has no outputs on its page"
        assert "Traceback (most recent call last)" not in page or name == "06_debugging_hangs", name
    ddp = (site / "tutorials" / "03_ddp.html").read_text()
    assert "nd-dashboard nd-final" in ddp  # the dashboard's record, static, in the page


def test_the_magic_reference_is_made_from_every_magic(site, ip):
    page = (site / "reference" / "magics.html").read_text()
    magics = ip.magics_manager.magics
    ours = {
        name
        for kind in ("line", "cell")
        for name, fn in magics[kind].items()
        if getattr(getattr(fn, "__self__", None), "__module__", "").startswith(
            "notebook_dist.magics"
        )
    }
    assert {"dist_init", "distributed", "dist_bench", "dist_profile", "dist_export"} <= ours
    for name in ours:
        assert re.search(rf"<code[^>]*><span class=\"pre\">%%?{name}</span>", page), name
    assert "--hang-after" in page and "number of ranks (default: one per GPU, or 2 on CPU)" in page


def test_the_hang_catalogue_shows_each_verdict_as_printed(site):
    page = text_of(site / "hangs.html")
    for said in (
        "Line 4 is inside `if nd.rank == 0:` (line 3)",
        "are in a point-to-point deadlock",
        "but rank 0 finished the cell without sending to it",
        "a collective torch issued inside full_tensor()",
        "the ranks ran different numbers of steps (uneven data per rank)",
        "Rank 1 is busy in Python",
        "rank 1 was killed by SIGKILL",
        "where the ranks passed: rank 0 (4,) float32; rank 1 (5,) float32",
        "rank 0 broadcasts from src=0 and rank 1 from src=1",
        "The ranks wait in collectives of different process groups: rank 0 waits in all_reduce",
        "at line 4 of evaluate() in Cell In[",
        "was not issued: the ranks pass different shapes (rank 0: (4,); rank 1: (5,))",
        "torch's collective timeout (4 s, %dist_init --timeout) ended all_reduce #1 at line 4 on rank 0",
    ):
        assert said in page, said
    # Gloo aborts the rank the wrong size reaches, or the overrun memory kills it first
    assert re.search(r"was killed by SIG(ABRT|SEGV|BUS) in all_reduce at line 2", page)


def test_the_troubleshooting_page_shows_the_projects_own_messages(site):
    page = text_of(site / "troubleshooting.html")
    for said in (
        "--port 70000: give a port number between 1 and 65535",
        "start the engines with ipyparallel's own launcher",
        "ranks 2-5 not in this cluster",
        "is not defined on ranks 0, 1",
        "this init_process_group() call is skipped",
    ):
        assert said in page, said


@pytest.mark.browser
def test_a_tutorial_page_shows_the_dashboard_record_in_chromium(site, tmp_path):
    if not os.path.exists(CHROMIUM):
        if os.environ.get("NOTEBOOK_DIST_REQUIRE_BROWSER") == "1":
            pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium")
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto((site / "tutorials" / "03_ddp.html").as_uri())
            record = page.locator(".nd-dashboard.nd-final").last
            record.scroll_into_view_if_needed()
            assert record.is_visible()
            rows = record.locator("tr.nd-rank-row")
            assert rows.count() == 2 and "done" in rows.first.inner_text()
            record.screenshot(path=str(tmp_path / "record.png"))
            assert (tmp_path / "record.png").stat().st_size > 1000
        finally:
            browser.close()


def test_the_site_documents_the_installed_package_from_any_folder(docs_python, tmp_path):
    """conf.py, run from another folder and from the checkout, imports the installed
    package, and the magic reference is made from the installed magics."""
    check = (
        "import runpy, sys\n"
        f"runpy.run_path({str(REPO / 'docs' / 'conf.py')!r})\n"
        "import magicref, notebook_dist, notebook_dist.magics\n"
        "pages = magicref.magic_pages()\n"
        "assert '### `%dist_heal`' in pages and '### `%%distributed`' in pages, pages[:500]\n"
        "print(notebook_dist.__file__)"
    )
    for cwd in (tmp_path, REPO):
        out = subprocess.run(
            [str(docs_python), "-c", check],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=clean_env(tmp_path, docs_python),
        )
        assert out.returncode == 0, (cwd, out.stderr[-3000:])
        assert out.stdout.strip() == f"{purelib(docs_python)}/notebook_dist/__init__.py", cwd
