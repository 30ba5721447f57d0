"""bench/render_report.py: the blank space below a page is cropped; a report renders in headless Chromium when installed."""

import importlib.util
import shutil
from pathlib import Path

import pytest

PIL = pytest.importorskip("PIL")
SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "render_report.py"


def _module():
    spec = importlib.util.spec_from_file_location("render_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blank_bottom_is_cropped_to_the_content(tmp_path):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (200, 1000), "white")
    ImageDraw.Draw(image).rectangle((10, 10, 150, 300), fill="black")
    path = tmp_path / "page.png"
    image.save(path)
    assert _module().crop_blank_bottom(path, margin=24) == (200, 301 + 24)
    assert Image.open(path).size == (200, 325)


@pytest.mark.skipif(not any(shutil.which(n) for n in ("chromium", "chromium-browser")), reason="no Chromium installed")
def test_a_page_renders_to_a_png(tmp_path):
    page = tmp_path / "report.html"
    page.write_text("<!DOCTYPE html><html><body style='margin:0'><div style='height:700px;background:#123456'></div></body></html>")
    width, height = _module().render(page, tmp_path / "report.png", width=400, height=3000)
    assert width == 400 and 700 <= height <= 760  # the 700-pixel block and the margin, not the 3000-pixel window
