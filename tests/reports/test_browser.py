"""Headless Chromium opens the report from disk: the figures render, no JS errors, no network, not blank."""
from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from meshplan.reports import write_report
from tests.report_fixtures import gpipe_intervals, make_plan, measured

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
                       reason="headless Chromium not installed (apt-get install chromium chromium-driver)"),
]


def _png_gray_pixels(png: bytes) -> list[int]:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) into gray values, without extra packages."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, header = 8, [], None
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        data = png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", data)
        elif kind == b"IDAT":
            chunks.append(data)
        pos += 12 + length
    width, height, depth, colour_type = header[:4]
    assert depth == 8 and colour_type in (2, 6), f"unexpected PNG format {depth=} {colour_type=}"
    channels = 3 if colour_type == 2 else 4
    raw, stride = zlib.decompress(b"".join(chunks)), width * channels
    previous, gray = bytearray(stride), []
    for row in range(height):
        start = row * (stride + 1)
        filter_type, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):  # undo the PNG row filters (spec section 9)
            left = line[i - channels] if i >= channels else 0
            up, up_left = previous[i], previous[i - channels] if i >= channels else 0
            if filter_type == 1:
                line[i] = (line[i] + left) & 0xFF
            elif filter_type == 2:
                line[i] = (line[i] + up) & 0xFF
            elif filter_type == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif filter_type == 4:
                p = left + up - up_left
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else up_left)) & 0xFF
        previous = line
        if row % 4 == 0:  # every 4th row is plenty for a variance
            gray.extend((line[i] + line[i + 1] + line[i + 2]) // 3 for i in range(0, stride, channels * 4))
    return gray


@pytest.fixture(scope="module")
def driver():
    pytest.importorskip("selenium", reason="selenium is in the dev extra: pip install -e '.[dev]'")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-dev-shm-usage", "--window-size=1280,1400"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    browser.set_page_load_timeout(40)
    yield browser
    browser.quit()


@pytest.mark.timeout(90)
def test_report_renders_in_chromium(driver, tmp_path):
    plan = make_plan()
    measured_path = tmp_path / "measured.json"
    measured_path.write_text(json.dumps(measured(plan, [1.0, 0.6, 0.62, 0.58])))
    out = write_report(plan, measurements=[measured_path], trace=gpipe_intervals(2, 8, 1e-3, 2e-3),
                       out=tmp_path / "report.html")
    num_figures = out.read_text().count('class="plotly-graph-div"')
    assert num_figures == 8  # 6 plan figures + measured steps + measured memory

    driver.get(out.resolve().as_uri())
    rendered = driver.execute_script("return document.querySelectorAll('.plotly-graph-div .plot-container').length")
    svgs = driver.execute_script("return document.querySelectorAll('.plotly-graph-div .main-svg').length")
    bars = driver.execute_script("return document.querySelectorAll('.plotly-graph-div g.point').length")
    assert rendered == num_figures, "every figure's plot container is built by plotly.js"
    assert svgs >= 2 * num_figures  # plotly draws a main and an overlay svg per figure
    assert bars > 50  # bars of the Gantt, memory, breakdown... drawn as svg paths
    # Nothing but the file itself was loaded: no network requests at all.
    resources = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert [r for r in resources if not r.startswith(("file:", "data:", "blob:"))] == []
    errors = [entry for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "ERROR")]
    assert errors == [], errors

    shot = tmp_path / "report.png"
    assert driver.save_screenshot(str(shot))
    gray = _png_gray_pixels(shot.read_bytes())
    mean = sum(gray) / len(gray)
    variance = sum((g - mean) ** 2 for g in gray) / len(gray)
    # A blank white page has variance 0; text, tables and coloured bars give hundreds.
    assert variance > 100, f"screenshot looks blank (gray variance {variance:.1f})"
