"""The README's first command, `python3 course.py lab`, in a real browser: it serves the
notebooks (as root too), and headless Chromium renders chapter 00 without a news pop-up.

The lab serves a temporary copy of notebooks/ (opening a notebook starts a kernel and writes
checkpoints) with temporary user settings, workspaces and runtime files, on a free port.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest

from test_slides import SCREEN, chromium, require_browser  # noqa: F401 (chromium: a fixture)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "00_devices.ipynb"
STARTUP_S = 90
NEWS_SETTINGS = "@jupyterlab/apputils-extension:notification"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(url: str, server: subprocess.Popen, log: Path) -> None:
    """Poll the server's status API until it answers; fail with its log if it exits or hangs."""
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"course.py lab exited with {server.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"course.py lab did not answer within {STARTUP_S} s:\n{log.read_text()}")


def stop(server: subprocess.Popen, shutdown_url: str, marker: str) -> list[str]:
    """Stop the server (its shutdown API, which stops the kernels too; then SIGTERM, SIGKILL)
    and any process still using this test's files; return what had to be killed afterwards."""
    for ask in (lambda: urllib.request.urlopen(urllib.request.Request(shutdown_url, b""), timeout=5),
                lambda: os.killpg(server.pid, signal.SIGTERM),
                lambda: os.killpg(server.pid, signal.SIGKILL)):
        if server.poll() is not None:
            break
        try:
            ask()
            server.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
    time.sleep(1)
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if any(marker in part for part in p.info["cmdline"] or [])]
    for process in leftovers:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass  # it ended by itself meanwhile
    return [" ".join(p.info["cmdline"]) for p in leftovers]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`python3 course.py lab --no-browser` on a free port, serving a copy of notebooks/."""
    require_browser()
    tmp = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", tmp / "notebooks")
    port, token, log = free_port(), secrets.token_hex(16), tmp / "lab.log"
    env = dict(os.environ,
               JUPYTERLAB_SETTINGS_DIR=str(tmp / "user-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp / "config"))
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, ROOT / "course.py", "lab", "--no-browser", "--ip=127.0.0.1",
             f"--port={port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp / 'notebooks'}"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(f"{base}/api/status?token={token}", server, log)
        yield {"base": base, "token": token, "log": log}
    finally:
        leftovers = stop(server, f"{base}/api/shutdown?token={token}", str(tmp))
    assert leftovers == [], f"processes left behind by course.py lab: {leftovers}"


def get_json(lab: dict, path: str) -> dict:
    with urllib.request.urlopen(f"{lab['base']}{path}?token={lab['token']}", timeout=10) as r:
        return json.load(r)


def wait_for_idle_kernel(lab: dict, timeout_s: float = 60) -> None:
    """Wait until the kernel the opened notebook started is idle (so it also stops cleanly)."""
    deadline, states = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        try:
            states = [k["execution_state"] for k in get_json(lab, "/api/kernels")]
        except urllib.error.HTTPError as error:
            # jupyter_server lists a starting kernel a moment before it sets the kernel's
            # last_activity, and answers 500 meanwhile (the race of
            # jupyter-server/enterprise_gateway#1395, reproduced with jupyter_server 2.21):
            # a transient answer while the kernel starts, so ask again.
            if error.code != 500:
                raise
            states = [f"HTTP 500 at {time.strftime('%X')}"]
        if states and all(state == "idle" for state in states):
            return
        time.sleep(0.5)
    pytest.fail(f"the notebook's kernel did not become idle within {timeout_s} s: {states}")


def test_lab_runs_as_root_with_allow_root(lab: dict) -> None:
    said = "passing --allow-root" in lab["log"].read_text()
    assert said == (os.geteuid() == 0), lab["log"].read_text()


def test_lab_switches_off_the_news_pop_up(lab: dict) -> None:
    # overrides.json changes the defaults in the schema the server sends to the browser
    schema = get_json(lab, f"/lab/api/settings/{NEWS_SETTINGS}")["schema"]
    assert schema["properties"]["fetchNews"]["default"] == "false"


def test_lab_serves_the_copy_of_the_notebooks(lab: dict) -> None:
    served = {item["name"] for item in get_json(lab, "/api/contents")["content"]}
    assert NOTEBOOK.name in served


def test_notebook_00_renders_in_chromium(lab: dict, chromium) -> None:  # noqa: F811
    cells = nbformat.read(NOTEBOOK, as_version=4).cells
    title = cells[0].source.splitlines()[0].lstrip("# ").strip()
    first_code = next(c for c in cells if c.cell_type == "code").source.splitlines()[0]
    page = chromium.new_page(viewport=SCREEN)
    try:
        page.goto(f"{lab['base']}/lab/tree/{NOTEBOOK.name}?token={lab['token']}")
        # JupyterLab renders cells lazily: wait until the title and a code cell are in the DOM.
        page.wait_for_function(
            """([title, code]) => {
                 const h1 = document.querySelector('.jp-Notebook .jp-MarkdownOutput h1');
                 const editors = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .cm-content')];
                 return h1 && h1.textContent.includes(title)
                     && editors.some(e => e.innerText.includes(code));
               }""",
            arg=[title, first_code], timeout=60_000)
        rendered = page.locator(".jp-Notebook .jp-Cell").count()
        assert rendered >= 3, f"only {rendered} cells rendered"
        news = page.get_by_text("official Jupyter news").count()
        assert news == 0, "the Jupyter news pop-up is shown"
        wait_for_idle_kernel(lab)
    finally:
        page.close()
