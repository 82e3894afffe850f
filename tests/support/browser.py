"""A real browser for the form tests: headless Chromium driven by Selenium.

Debian's ``chromium`` and ``chromium-driver`` (``/usr/bin/chromium``,
``/usr/bin/chromedriver``; ``IDEMPOTENCY_TEST_CHROMIUM`` and
``IDEMPOTENCY_TEST_CHROMEDRIVER`` point elsewhere), driven by Selenium from the
package index. Selenium is never allowed to fetch a browser or a driver of its
own: the paths are given. Where either is missing, or the browser does not
start, the tests that want it are SKIPPED with the reason (``pytest -ra`` lists
it), never silently passed.

One browser serves a whole test session (starting Chromium costs about a
second); :func:`fresh_browser` gives each test a clean one: one tab, no cookies,
no page.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import typing as t

import pytest

CHROMIUM_ENV = "IDEMPOTENCY_TEST_CHROMIUM"
CHROMEDRIVER_ENV = "IDEMPOTENCY_TEST_CHROMEDRIVER"
#: How long a page may take to load, and a script to run, before the test fails.
PAGE_LOAD_TIMEOUT = 30
#: How long the tests wait for a page to show what they expect.
WAIT = 15

#: Chromium's flags. ``--disable-prompt-on-repost``: reloading the result of a
#: POST resubmits it without the "Confirm form resubmission" dialog, as a person
#: who clicks through it does (a dialog would stop a headless browser).
FLAGS = (
    "--headless=new",
    "--disable-prompt-on-repost",
    "--disable-gpu",
    "--disable-dev-shm-usage",  # /dev/shm is small in containers
    "--disable-extensions",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--password-store=basic",
    "--window-size=800,600",
)


def _find(env: str, *candidates: str) -> str | None:
    configured = os.environ.get(env)
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    for name in candidates:
        found = shutil.which(name) or (name if os.access(name, os.X_OK) else None)
        if found:
            return found
    return None


def found() -> str:
    """The browser and driver the tests use (for the report header)."""
    chromium = _find(CHROMIUM_ENV, "/usr/bin/chromium", "chromium")
    driver = _find(CHROMEDRIVER_ENV, "/usr/bin/chromedriver", "chromedriver")
    return f"{chromium} with {driver}"


def missing() -> str | None:
    """Why the browser tests cannot run here, or ``None`` when they can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -r requirements-dev.txt)"
    if _find(CHROMIUM_ENV, "/usr/bin/chromium", "chromium") is None:
        return (
            "Chromium is not installed (Debian: apt-get install chromium chromium-driver; "
            f"or set {CHROMIUM_ENV})"
        )
    if _find(CHROMEDRIVER_ENV, "/usr/bin/chromedriver", "chromedriver") is None:
        return (
            "chromedriver is not installed (Debian: apt-get install chromium-driver; "
            f"or set {CHROMEDRIVER_ENV})"
        )
    return None


def start() -> t.Any:
    """A new headless Chromium session (a ``selenium.webdriver.Chrome``); skips the
    calling test, with the reason, where it cannot run or does not start."""
    reason = missing()
    if reason is not None:
        pytest.skip(f"no browser: {reason}")
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    chromium = _find(CHROMIUM_ENV, "/usr/bin/chromium", "chromium")
    driver_path = _find(CHROMEDRIVER_ENV, "/usr/bin/chromedriver", "chromedriver")
    assert chromium is not None
    assert driver_path is not None
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS:
        options.add_argument(flag)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Chromium's sandbox refuses to run as root.
        options.add_argument("--no-sandbox")
    # No --user-data-dir: chromedriver makes a temporary profile and removes it on quit.
    try:
        driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    except WebDriverException as exc:
        first = (exc.msg or str(exc)).strip().splitlines()[0]
        pytest.skip(f"no browser: Chromium did not start ({chromium}, {driver_path}): {first}")
    driver.set_page_load_timeout(PAGE_LOAD_TIMEOUT)
    driver.set_script_timeout(PAGE_LOAD_TIMEOUT)
    return driver


def reset(driver: t.Any) -> None:
    """Back to one blank tab with no cookies and no history worth going back to."""
    handles = driver.window_handles
    for handle in handles[1:]:
        driver.switch_to.window(handle)
        driver.close()
    driver.switch_to.window(handles[0])
    driver.get("about:blank")
    driver.delete_all_cookies()


class Browsers:
    """The session's one Chromium, started on first use, started again when a
    test left it unusable (crashed, hung on a page), quit at the session's end."""

    def __init__(self) -> None:
        self.driver: t.Any = None

    def clean(self) -> t.Any:
        from selenium.common.exceptions import WebDriverException

        if self.driver is not None:
            try:
                reset(self.driver)
                return self.driver
            except WebDriverException:
                self.quit()
        self.driver = start()
        return self.driver

    def quit(self) -> None:
        driver, self.driver = self.driver, None
        if driver is not None:
            with contextlib.suppress(Exception):  # a dead browser: nothing left to stop
                driver.quit()


@pytest.fixture(scope="session")
def browsers() -> t.Iterator[Browsers]:
    holder = Browsers()
    try:
        yield holder
    finally:
        holder.quit()


@pytest.fixture
def browser(browsers: Browsers) -> t.Any:
    """The session's Chromium, clean for this test: one blank tab, no cookies."""
    return browsers.clean()
