"""Make docs/serve-lineage.png and docs/serve-diff.png (the README's pictures of `ckpt serve`).

    bash examples/demo.sh                  # the demo store: demo-work/store
    python docs/make_screenshots.py        # needs the web and test extras and Debian's chromium

The lineage graph is of the test store (tests/cli/webstore.py: a base, two fine-tunes, a
merge and a training run); the diff is the demo's MiniLM fine-tune against its base.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "cli"))


def serve(url: str, port: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "ckpt_store.cli.main", "--store", url, "serve", "--port", str(port)],
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    print(p.stdout.readline().strip())
    return p


def main() -> None:
    from webstore import build

    demo = ROOT / "demo-work" / "store"
    if not demo.exists():
        sys.exit("run `bash examples/demo.sh` first: the diff picture is of the demo store")
    store = build(tempfile.mkdtemp() + "/store", probe=False)
    servers = [serve(store.url, 8771), serve(str(demo), 8772)]
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            pg = b.new_page(viewport={"width": 1200, "height": 560})
            pg.goto("http://127.0.0.1:8771/lineage")
            pg.screenshot(path=str(ROOT / "docs" / "serve-lineage.png"))
            pg.set_viewport_size({"width": 1200, "height": 900})
            pg.goto("http://127.0.0.1:8772/diff?a=minilm/base&b=minilm/ft-top")
            pg.screenshot(path=str(ROOT / "docs" / "serve-diff.png"))
            b.close()
    finally:
        for p in servers:
            p.terminate()
            p.wait()


if __name__ == "__main__":
    main()
