"""A headless Chromium that can reach 127.0.0.1 and nothing else: for the page's tests and screenshot.

Playwright's own browser download needs the internet, so Playwright's Python API drives the Linux
distribution's Chromium (Debian: `apt-get install chromium`). Every request the page makes to another
host is aborted and recorded in `off_host`, so a caller can assert that the page asked for nothing
outside the machine. Chromium's own background traffic (updates, sync, safe browsing) never reaches
the page's routing, so it is switched off with flags, and each launch gets a fresh, empty profile.
"""

import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
LOCAL_HOST = "127.0.0.1"


class ChromiumMissing(RuntimeError):
    pass


@dataclass
class LocalBrowser:
    context: object  # playwright.sync_api.BrowserContext
    off_host: list[str] = field(default_factory=list)  # URLs the page tried to load from another host

    def _route(self, route) -> None:
        if urlsplit(route.request.url).hostname == LOCAL_HOST:
            route.continue_()
        else:
            self.off_host.append(route.request.url)
            route.abort("blockedbyclient")


@contextmanager
def local_browser(width: int = 1280, height: int = 900, scale: float = 1):
    """`with local_browser() as browser:` browser.context.new_page(), browser.off_host."""
    if not CHROMIUM.exists():
        raise ChromiumMissing(f"{CHROMIUM} not found: install Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright  # only the page's tests and screenshot need it

    with sync_playwright() as playwright, tempfile.TemporaryDirectory(prefix="mnv3-chromium-") as profile:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=str(CHROMIUM),
            headless=True,
            args=list(CHROMIUM_FLAGS),
            viewport={"width": width, "height": height},
            device_scale_factor=scale,
        )
        browser = LocalBrowser(context)
        context.route("**/*", browser._route)
        try:
            yield browser
        finally:
            context.close()
