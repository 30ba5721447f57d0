"""Render a report.html (written by ``hf-posext report DIR``) in headless Chromium to a PNG, to look at.

    python bench/render_report.py bench/results/quality/report.html            # -> report.png beside it
    python bench/render_report.py results/demo/report.html --out /tmp/demo.png --width 1280

Needs Debian's ``chromium`` package (``apt-get install -y chromium``). The page is opened from the file
(no server: the report is self-contained), captured in a window taller than any report, and the blank
space below the page is cropped with Pillow.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def find_chromium() -> str:
    """The Chromium executable on PATH.

    Raises:
        FileNotFoundError: none is installed.
    """
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("No Chromium found on PATH; install it with `apt-get update && apt-get install -y chromium`.")


def crop_blank_bottom(path: Path, margin: int = 24) -> tuple[int, int]:
    """Crop the uniform background below the page's content; returns the new (width, height)."""
    from PIL import Image, ImageChops

    with Image.open(path) as image:
        rgb = image.convert("RGB")
    background = Image.new("RGB", rgb.size, rgb.getpixel((rgb.width - 1, rgb.height - 1)))
    box = ImageChops.difference(rgb, background).getbbox()
    bottom = min(rgb.height, (box[3] if box else rgb.height) + margin)
    rgb.crop((0, 0, rgb.width, bottom)).save(path)
    return rgb.width, bottom


def render(html: Path, out: Path, width: int = 1280, height: int = 16000, timeout: float = 120.0) -> tuple[int, int]:
    """Screenshot ``html`` with headless Chromium into ``out`` (PNG), cropped to the page; returns its size.

    Raises:
        FileNotFoundError: ``html`` or Chromium is missing.
        RuntimeError: Chromium failed or wrote no image.
    """
    if not html.is_file():
        raise FileNotFoundError(f"{html} does not exist; write it with `hf-posext report DIR`.")
    chromium = find_chromium()
    with tempfile.TemporaryDirectory() as profile:
        target = out.with_name(out.name + ".tmp.png")
        command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                   f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={target}",
                   html.resolve().as_uri()]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0 or not target.is_file():
            raise RuntimeError(f"Chromium failed (exit {result.returncode}): {result.stderr.strip().splitlines()[-1:]}")
        size = crop_blank_bottom(target)
        target.replace(out)
    return size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html", type=Path, help="a report.html")
    parser.add_argument("--out", type=Path, help="PNG to write (default: the HTML's name with .png)")
    parser.add_argument("--width", type=int, default=1280, help="window width in CSS pixels")
    parser.add_argument("--height", type=int, default=16000, help="capture height before cropping (taller than the page)")
    args = parser.parse_args(argv)
    try:
        width, height = render(args.html, args.out or args.html.with_suffix(".png"), args.width, args.height)
    except (FileNotFoundError, RuntimeError) as error:
        print(f"render_report: error: {error}", file=sys.stderr)
        return 2
    print(f"{args.out or args.html.with_suffix('.png')}: {width} x {height} px")
    return 0


if __name__ == "__main__":
    sys.exit(main())
