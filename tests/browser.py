"""Headless Chromium for the HTML report's tests (the Debian package ``chromium``; .ci/run installs it)."""

from __future__ import annotations

import os
import re
import shutil

import pytest


def find_chromium() -> str | None:
    if os.path.exists("/usr/bin/chromium"):
        return "/usr/bin/chromium"
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


CHROMIUM = find_chromium()
NEEDS_CHROMIUM = pytest.mark.skipif(CHROMIUM is None,
                                    reason="needs Chromium (Debian package chromium) at /usr/bin/chromium")
# What would make a page fetch something: a URL in an attribute, or a CSS url(...)
NETWORK_REFERENCE = re.compile(r"""(?:src|href|action|srcset|poster|data)\s*=\s*["']?\s*(?:https?:)?//|url\(""", re.I)
