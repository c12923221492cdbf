"""The dashboard in a real JupyterLab, in Debian's Chromium, driven by Playwright.

Runs wherever /usr/bin/chromium exists; in CI (NOTEBOOK_DIST_REQUIRE_BROWSER=1) a
missing browser is a failure, never a skip.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import pids_alive, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
REQUIRED = os.environ.get("NOTEBOOK_DIST_REQUIRE_BROWSER") == "1"

CELLS = [
    "%load_ext notebook_dist\n%dist_init -n 2",
    "%%distributed\nimport time\nfor step in range(1, 51):\n    time.sleep(0.04)\n"
    "    nd.report(step=step, total=50, loss=1.0 / step + 0.1 * nd.rank, samples=16)\nprint('trained')",
    # a breakpoint on rank 1: its prompt comes in JupyterLab's input box
    "%%distributed\nsecret = nd.rank * 7\nif nd.rank == 1:\n    breakpoint()\ndist.barrier()\n"
    "print('after the debugger')",
]


def _notebook(path: Path) -> None:
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": f"c{i}",
                "metadata": {},
                "outputs": [],
                "source": src,
            }
            for i, src in enumerate(CELLS)
        ],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    if not os.path.exists(CHROMIUM):
        if REQUIRED:
            pytest.fail(
                f"Chromium is required here but {CHROMIUM} is missing (apt-get install chromium)"
            )
        pytest.skip(
            "no Chromium on this machine (Debian package chromium); CI installs it and runs this test"
        )
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        IPYTHONDIR=str(tmp_path / "ipy"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"),
    )
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false"}'
    )  # no news toast
    root = tmp_path / "nb"
    root.mkdir()
    _notebook(root / "dashboard.ipynb")
    log = open(tmp_path / "lab.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.news_url=",
            "--allow-root",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=root,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            return True
        except OSError:
            return False

    if not wait_until(answers, 60, every_s=0.3):
        proc.kill()
        pytest.fail("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
    yield {
        "url": f"{base}/lab/tree/dashboard.ipynb?token={token}",
        "base": base,
        "token": token,
        "tmp": tmp_path,
    }
    _shutdown_kernels({"base": base, "token": token})  # their clusters go with them
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _shutdown_kernels(lab) -> None:
    """Every kernel of the server, shut down as JupyterLab's "Shut Down Kernel" does."""
    base, token = lab["base"], lab["token"]
    try:
        req = urllib.request.Request(f"{base}/api/kernels?token={token}")
        for k in json.load(urllib.request.urlopen(req, timeout=5)):
            urllib.request.urlopen(
                urllib.request.Request(
                    f"{base}/api/kernels/{k['id']}?token={token}", method="DELETE"
                ),
                timeout=20,
            )
    except OSError:
        pass


def test_dashboard_renders_live_and_ends_done(lab):
    from playwright.sync_api import sync_playwright

    shots = Path(os.environ.get("NOTEBOOK_DIST_SCREENSHOT_DIR", lab["tmp"]))
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_page(viewport={"width": 1500, "height": 900})
        try:
            page.goto(lab["url"])
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            page.get_by_text("| Idle").wait_for(timeout=60_000)  # the kernel is connected
            prompt = page.locator(".jp-Cell .jp-InputPrompt").first
            for _ in range(3):  # a run sent before the kernel is really ready is dropped: retry
                page.locator(".jp-Cell").first.click()
                page.get_by_role("menuitem", name="Run", exact=True).click()
                page.get_by_text("Run All Cells", exact=True).click()
                try:
                    page.wait_for_function(
                        "el => /\\[(\\*|\\d+)\\]/.test(el.textContent)",
                        arg=prompt.element_handle(),
                        timeout=15_000,
                    )
                    break
                except Exception:
                    continue
            live = page.locator(".nd-dashboard.nd-live")
            live.wait_for(timeout=90_000)
            page.wait_for_function(
                "document.querySelectorAll('.nd-live .nd-rank-row').length === 2", timeout=30_000
            )
            # the live rows count steps while the cell runs
            page.wait_for_function(
                "[...document.querySelectorAll('.nd-live .nd-step')].every(e => parseInt(e.textContent) >= 10)",
                timeout=30_000,
            )
            page.screenshot(path=str(shots / "dashboard-live.png"))
            final = page.locator(".nd-dashboard.nd-final")
            final.wait_for(timeout=60_000)
            rows = final.locator(".nd-rank-row")
            assert rows.count() == 2
            for i in range(2):
                assert rows.nth(i).locator(".nd-state").get_attribute("data-state") == "done"
                assert rows.nth(i).locator(".nd-step").inner_text() == "50/50"
            final.scroll_into_view_if_needed()
            page.screenshot(path=str(shots / "dashboard.png"))
            # the debugger's prompt, in the input box: a command typed there runs on rank 1
            box = page.locator("input.jp-Stdin-input")
            box.wait_for(timeout=60_000)
            assert "[rank 1] (Pdb)" in page.locator(".jp-Stdin-prompt").last.inner_text()
            box.fill("p secret")
            box.press("Enter")
            shows = "t => document.querySelector('.jp-Notebook').innerText.includes(t)"
            page.wait_for_function(shows, arg="[rank 1] 7\n", timeout=30_000)
            # the next prompt comes in a fresh input box (the answered one stays, as text)
            page.wait_for_function(
                "() => document.querySelectorAll('input.jp-Stdin-input').length === 1"
                " && !document.querySelector('input.jp-Stdin-input').value",
                timeout=30_000,
            )
            nxt = page.locator("input.jp-Stdin-input")
            nxt.fill("c")
            nxt.press("Enter")
            page.wait_for_function(shows, arg="[rank 1] after the debugger", timeout=30_000)
            page.screenshot(path=str(shots / "debugger.png"))
            text = page.locator(".jp-Notebook").inner_text()
            assert "[rank 1] trained" in text
            # the ranks' pids, from the rank table %dist_init printed
            pids = [int(m) for m in re.findall(r"^\s*[01]\s+\S+\s+(\d+)\s+cpu\s+gloo", text, re.M)]
        except Exception:
            page.screenshot(path=str(lab["tmp"] / "failure.png"))
            print("NOTEBOOK TEXT:\n" + page.locator("body").inner_text()[-3000:])
            print("FAILURE SCREENSHOT:", lab["tmp"] / "failure.png")
            raise
        finally:
            browser.close()
    assert (shots / "dashboard.png").stat().st_size > 10_000
    # the kernel shut down from JupyterLab's side takes its ranks with it
    assert len(pids) == 2 and pids_alive(pids) == pids, pids
    _shutdown_kernels(lab)
    assert wait_until(lambda: not pids_alive(pids), 20), f"ranks outlived the kernel: {pids}"
