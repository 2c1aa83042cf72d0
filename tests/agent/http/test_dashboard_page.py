"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright)
against three agent processes serving SmolLM2: the page loads without console errors, shows
the three devices and the layer map, a chat message streams an answer, and a device killed
with SIGKILL turns dead on the page within the failure threshold. A phone-sized page shows
the same. Screenshots are kept in $NCM_TEST_ARTIFACTS (default `.test-artifacts/` in the
repository) as artifacts of the run."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.agent.agents import FAST_TIMING, REPO, cluster_ready, make_agents, shut_down, wait_for

pytestmark = pytest.mark.slow
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
# Marked dead after `failure_threshold` failed contacts `health_interval_s` apart; the page polls each second.
DEAD_WITHIN_S = (float(FAST_TIMING["NCM_HEALTH_INTERVAL_S"]) * int(FAST_TIMING["NCM_FAILURE_THRESHOLD"])
                 + float(FAST_TIMING["NCM_PEER_TIMEOUT_S"]) + 1.0 + 2.0)
QUESTION = "What is the capital of France? Answer in one sentence."


def chromium() -> str:
    found = next((path for path in CHROMIUM_PATHS if Path(path).exists()), None) or shutil.which("chromium")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium (image/ci-setup does)")
        pytest.skip("no Chromium here (Debian: apt-get install chromium)")
    return found


@pytest.fixture()
def artifacts() -> Path:
    folder = Path(os.environ.get("NCM_TEST_ARTIFACTS", REPO / ".test-artifacts")) / "dashboard"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_the_dashboard_shows_the_cluster_streams_a_chat_and_sees_a_device_die(smollm2_store, tmp_path, artifacts):
    playwright_api = pytest.importorskip("playwright.sync_api")
    executable = chromium()
    agents = make_agents(tmp_path, smollm2_store.root, 3)
    try:
        status = wait_for(lambda: cluster_ready(agents[0], 3), timeout_s=240, what="a 3-node cluster serving")
        roles = {agent.node_id(): agent for agent in agents}
        workers = [node for node in roles if node != status["orchestrator"]]
        host, victim = roles[workers[0]], workers[1]  # the page is served by a worker, the other one dies

        with playwright_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
            problems: list[str] = []
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda message: problems.append(f"console {message.type}: {message.text}")
                    if message.type in ("error", "warning") else None)
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.goto(host.url + "/")

            # Waits go through selectors, which Playwright reads from its own world: a predicate it
            # evaluates in the page's needs 'unsafe-eval', which the page's CSP rightly refuses.
            playwright_api.expect(page.locator(".node[data-alive='true']")).to_have_count(3, timeout=15_000)
            assert sorted(page.eval_on_selector_all(".node", "nodes => nodes.map(n => n.dataset.node)")) == sorted(roles)
            page.wait_for_selector("svg.layer-map[data-model='smollm2-135m']", timeout=15_000)
            rows = page.eval_on_selector_all("svg.layer-map g.lrow", "rows => rows.map(r => r.dataset.rowNode)")
            assert sorted(rows) == sorted(roles)
            assert page.locator("svg.layer-map rect.cell.route").count() == 30  # every layer once on the route
            page.wait_for_selector(".model[data-model='smollm2-135m'][data-state='ready']", timeout=15_000)
            page.screenshot(path=str(artifacts / "1-cluster.png"), full_page=True)

            # a chat message, answered greedily: the answer grows while it streams, then says Paris
            page.select_option("#chat-model", "smollm2-135m")
            page.fill("#chat-temperature", "0")
            page.fill("#chat-input", QUESTION)
            page.click("#chat-send")
            answer = page.locator("#chat-log .msg.assistant").last
            lengths = set()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                lengths.add(len(answer.inner_text()))
                if "streaming" not in (answer.get_attribute("class") or ""):
                    break
                time.sleep(0.05)
            text = answer.inner_text()
            assert "Paris" in text, text
            assert len({n for n in lengths if 0 < n < len(text)}) >= 2, f"the answer did not stream: {lengths}"
            page.screenshot(path=str(artifacts / "2-chat.png"), full_page=True)
            assert not problems, problems

            # Stop: the answer so far stays, the form takes the next message
            page.fill("#chat-input", "Write a long story about a dragon who learns to cook.")
            page.click("#chat-send")
            stopping = page.locator("#chat-log .msg.assistant").last
            page.wait_for_selector("#chat-log .msg.assistant.streaming:not(:empty)", timeout=120_000)
            page.click("#chat-stop")
            page.wait_for_selector("#chat-send:enabled", timeout=30_000)
            assert "streaming" not in (stopping.get_attribute("class") or "") and stopping.inner_text()
            assert "stopped" in page.locator("#chat-stats").inner_text()
            assert page.locator("#chat-stop").is_hidden() and not problems, problems

            phone = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
            phone.goto(host.url + "/")
            phone.wait_for_selector("svg.layer-map", timeout=15_000)
            assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), "scrolls sideways"
            phone.screenshot(path=str(artifacts / "3-phone.png"), full_page=True)

            # SIGKILL a device: the page marks it dead within the failure threshold
            killed_at = time.monotonic()
            roles[victim].kill()
            page.wait_for_selector(f".node[data-node='{victim}'][data-alive='false']",
                                   timeout=DEAD_WITHIN_S * 1000)
            took_s = time.monotonic() - killed_at
            page.wait_for_selector("#event-log li[data-kind='death']", timeout=10_000)
            page.screenshot(path=str(artifacts / "4-device-dead.png"), full_page=True)
            browser.close()
        assert took_s <= DEAD_WITHIN_S
    finally:
        shut_down(agents, keep_store=smollm2_store.root)
