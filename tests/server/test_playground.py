"""The playground page at `/`: served from the package with nothing external,
and, in headless Chromium, a chat and an infill whose drafts sharpen on the
page and end at the API's own answer for the same seed."""

import os
import re
import shutil

import httpx
import pytest

from tests.server.test_server import KEY, start_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
  proc, base = start_server(tiny_checkpoints["mdlm"], f"--api-key={KEY}", "--slots=2", "--model-id=tiny",
                            "--admit-batch=1", "--no-warmup")  # compiles what the page uses, on first use
  yield base
  proc.kill()


def test_the_page_and_its_script_are_served_without_anything_external(tiny_checkpoints):
  from fastapi.testclient import TestClient
  from mdlm_jax import checkpoints
  from mdlm_jax.engine.engine import Engine
  from mdlm_jax.server.app import create_app
  engine = Engine(checkpoints.load(tiny_checkpoints["mdlm"]), num_slots=1, max_prompt=32, max_new_tokens=16,
                  block_size=8)
  http = TestClient(create_app(engine, model_id="tiny", api_key=KEY))
  page = http.get("/")  # no key needed for the page itself
  assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
  for element in ("tab-chat", "tab-fim", "effort", "seed", "chat-input", "fim-prefix", "fim-suffix", "stats-tps",
                  "stats-passes"):
    assert f'id="{element}"' in page.text
  script = http.get("/playground.js")
  assert script.status_code == 200 and "javascript" in script.headers["content-type"]
  assert "diffusing: true" in script.text
  # No CDN: every URL the page or its script loads is this server's.
  assert not re.findall(r"(?:src|href)=\"(?:https?:)?//", page.text)
  assert not re.findall(r"https?://", script.text)


def _chrome():
  webdriver = pytest.importorskip("selenium.webdriver")
  if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("needs Debian's chromium and chromium-driver")
  from selenium.webdriver.chrome.service import Service
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,900"):
    options.add_argument(arg)
  return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def _set(driver, element_id, value, event="change"):
  driver.execute_script("const el = document.getElementById(arguments[0]); el.value = arguments[1];"
                        " el.dispatchEvent(new Event(arguments[2]));", element_id, str(value), event)


def _wait_done(driver, timeout=180):
  from selenium.webdriver.support.ui import WebDriverWait
  WebDriverWait(driver, timeout).until(
      lambda d: d.find_element("id", "status").get_attribute("data-state") in ("done", "error"))
  assert driver.find_element("id", "status").get_attribute("data-state") == "done"


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and chromium-driver")
def test_chat_and_infill_sharpen_on_the_page_and_match_the_api(server, tmp_path):
  import openai
  from selenium.webdriver.support.ui import WebDriverWait
  driver = _chrome()
  try:
    driver.get(server + "/")
    _set(driver, "api-key", KEY)
    WebDriverWait(driver, 30).until(lambda d: "tiny" in d.find_element("id", "model").text)
    _set(driver, "effort", 1, "input")  # low
    assert driver.find_element("id", "effort-name").text == "low"
    for element_id, value in (("seed", 7), ("temperature", 0.8), ("max-tokens", 24)):
      _set(driver, element_id, value)
    # Note whether any draft drew undecided positions on its way. The mutation
    # records keep every node added, also one a later draft of the same task
    # replaced before the observer ran (several drafts can arrive in one read).
    driver.execute_script("window.sawUndecided = false; new MutationObserver((records) => {"
                          " for (const r of records) for (const n of r.addedNodes)"
                          "  if (n.nodeType === 1 && n.classList.contains('undecided')) window.sawUndecided = true; })"
                          ".observe(document.body, {subtree: true, childList: true});")
    prompt = "Write a function that adds two numbers."
    driver.find_element("id", "chat-input").send_keys(prompt)
    driver.find_element("id", "chat-send").click()
    _wait_done(driver)
    shown = driver.execute_script("return document.querySelector('.msg.assistant').textContent")
    assert driver.execute_script("return window.sawUndecided")
    assert int(driver.find_element("id", "stats-passes").text) > 0
    assert int(driver.find_element("id", "stats-drafts").text) >= 2
    assert float(driver.find_element("id", "stats-tps").text) > 0
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)
    want = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], seed=7,
                                          temperature=0.8, max_tokens=24, reasoning_effort="low")
    assert shown == want.choices[0].message.content

    driver.find_element("id", "tab-fim").click()
    assert driver.find_element("id", "panel-chat").get_attribute("hidden") is not None
    prefix, suffix = driver.find_element("id", "fim-prefix"), driver.find_element("id", "fim-suffix")
    driver.find_element("id", "fim-send").click()
    _wait_done(driver)
    middle = driver.execute_script("return document.getElementById('fim-middle').textContent")
    fim = httpx.post(server + "/v1/fim/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                     json={"model": "tiny", "prompt": prefix.get_attribute("value"),
                           "suffix": suffix.get_attribute("value"), "seed": 7, "temperature": 0.8, "max_tokens": 24,
                           "reasoning_effort": "low"}).json()
    assert middle == fim["choices"][0]["text"]
    shot = tmp_path / "playground.png"
    assert driver.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(shot) > 10_000
  finally:
    driver.quit()


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_the_page_marks_what_a_draft_took_back_as_revised():
  """The script's own `kinds`, run by node: undecided, revised (decided before as something else), text."""
  import json
  import subprocess
  src = open(os.path.join(os.path.dirname(__file__), "../../mdlm_jax/server/static/playground.js"),
             encoding="utf-8").read()
  mask = re.search(r"const MASK = [^\n]*\n", src).group(0)
  kinds = src[src.index("function kinds"):src.index("// Draws")]
  cases = [("ab\u2591\u2591", "ax\u2591\u2591"), ("abc", None), ("a\u2591", "ab"), ("abcd", "ab\u2591\u2591")]
  script = mask + kinds + f"console.log(JSON.stringify({json.dumps(cases)}.map(([t, p]) => kinds(t, p))));"
  out = json.loads(subprocess.run(["node", "-e", script], capture_output=True, text=True, check=True).stdout)
  assert out == [["text", "revised", "undecided", "undecided"], ["text"] * 3, ["text", "undecided"], ["text"] * 4]
