"""The page at `/` in headless Chromium (Debian's `chromium` and `chromium-driver`, installed
by tests/python/install-chromium.sh; Selenium offline, so it downloads no browser): a prompt
streams in as tokens, a selected token shows the candidates it was drawn from, the JSON-schema
box, the API-key prompt, and chat mode. Every value the page shows is checked against the same
request made directly to the API (same seed, non-streaming).

The screenshot of the first test's state (a token selected, its chart shown) is written to
<repo>/target/test-artifacts/serve-page.png, a smaller one to serve-page-small.png (the one in
docs/), and chat mode's to serve-page-chat.png."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jsonschema
import pytest

from conftest import REPO, STORIES, Server

PROMPT = "Once upon a time"
ARTIFACTS = REPO / "target" / "test-artifacts"
REMOVED = -9999.0
WINDOW = (1280, 860)
SMALL_WINDOW = (1100, 720)
WAIT_S = 30
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


# --- the browser -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def driver():
    missing = os.environ.get("NUCLEUS_CHROMIUM_MISSING")
    if missing:
        pytest.fail(f"Chromium could not be installed, so the page is untested: {missing}")
    for path in ("/usr/bin/chromium", "/usr/bin/chromedriver"):
        if not Path(path).exists():
            pytest.fail(f"no {path}: run tests/python/install-chromium.sh (it needs apt-get), "
                        "or tests/python/run.sh, which runs it")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not fetch a browser or a driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    set_viewport(d, *WINDOW)
    yield d
    d.quit()


@pytest.fixture(scope="module")
def keyed_page_server():
    s = Server(STORIES, "--served-model-name", "tiny", api_key="page-secret")
    yield s
    s.stop()


def set_viewport(d, width: int, height: int) -> None:
    """Sizes the window so that the page itself gets `width` x `height` pixels."""
    d.set_window_size(width, height)
    extra_w, extra_h = d.execute_script(
        "return [window.outerWidth - window.innerWidth, window.outerHeight - window.innerHeight]")
    if extra_w or extra_h:
        d.set_window_size(width + extra_w, height + extra_h)


def by_id(d, id_: str):
    from selenium.webdriver.common.by import By
    return d.find_element(By.ID, id_)


def wait(d, predicate, what: str, timeout: float = WAIT_S):
    from selenium.webdriver.support.ui import WebDriverWait
    try:
        return WebDriverWait(d, timeout, poll_frequency=0.05).until(lambda _: predicate())
    except Exception as e:
        status = d.execute_script("return document.getElementById('status').textContent")
        raise AssertionError(f"timed out waiting for {what}; #status says {status!r}") from e


def console_errors(d) -> list[str]:
    """The page's console errors since the last call (a CSP violation, an exception), less
    Chromium's line for each HTTP error answer, which the tests cause on purpose."""
    return [e["message"] for e in d.get_log("browser")
            if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]]


def open_page(d, server: Server) -> None:
    console_errors(d)
    d.get(server.base + "/")
    wait(d, lambda: by_id(d, "model").get_attribute("data-model"), "the model name")


def fill(d, id_: str, value) -> None:
    e = by_id(d, id_)
    e.clear()
    if value != "":
        e.send_keys(str(value))


def set_params(d, **params) -> None:
    for k, v in params.items():
        if k == "logprobs_mode":
            d.execute_script("document.getElementById('logprobs_mode').value = arguments[0]", v)
        else:
            fill(d, k, v)


def generate(d, timeout: float = WAIT_S) -> str:
    """Clicks Generate and waits until the run ends; returns the status state."""
    d.execute_script("document.getElementById('status').dataset.state = 'clicked'")
    by_id(d, "generate").click()
    return wait(d, lambda: (s := by_id(d, "status").get_attribute("data-state"))
                not in ("clicked", "streaming") and s, "the generation to end", timeout)


def page_tokens(d) -> list[str]:
    return d.execute_script(
        "return [...document.querySelectorAll('#output .token')].map(t => t.dataset.token)")


def panel(d) -> dict:
    """The candidates panel as shown: rows (token, data-prob, percent text, chosen)."""
    return d.execute_script("""
        const rows = [...document.querySelectorAll('#dist .cand')].map(r => ({
            token: r.dataset.token, prob: Number(r.dataset.prob),
            pct: r.querySelector('.pct').textContent, chosen: r.dataset.chosen === '1',
            chosenClass: r.classList.contains('chosen'),
            width: r.querySelector('.fill').style.width}));
        const info = document.getElementById('info');
        return {rows, index: Number(info.dataset.index), prob: Number(info.dataset.prob),
                rank: info.dataset.rank, removed: Number(document.getElementById('dist-note').dataset.removed || 0),
                selected: [...document.querySelectorAll('#output .token.selected')].map(t => Number(t.dataset.index))};
    """)


def click_token(d, i: int) -> None:
    from selenium.webdriver.common.by import By
    d.find_element(By.CSS_SELECTOR, f'#output .token[data-index="{i}"]').click()


def assert_pct(shown: str, p: float) -> None:
    if shown == "<0.01%":
        assert 0 < p * 100 < 0.005, (shown, p)
    else:
        assert shown.endswith("%"), shown
        assert abs(float(shown[:-1]) - p * 100) <= 0.005 + 1e-9, (shown, p)


def assert_panel(d, i: int, token: str, logprob: float, top: list[tuple[str, float]],
                 k: int) -> dict:
    """The panel of token `i` against the API's answer for that position: the kept candidates
    (logprob > -9999) by falling probability, each as exp(logprob), the chosen one marked."""
    p = panel(d)
    assert p["index"] == i and p["selected"] == [i], p
    kept = sorted(((t, lp) for t, lp in top if lp > REMOVED), key=lambda x: -x[1])
    assert [r["token"] for r in p["rows"]] == [t for t, _ in kept], (p["rows"], kept)
    chosen_at = next((j for j, (t, _) in enumerate(kept) if t == token), None)
    for j, (r, (t, lp)) in enumerate(zip(p["rows"], kept)):
        assert math.isclose(r["prob"], math.exp(lp), rel_tol=1e-9), (r, lp)
        assert_pct(r["pct"], math.exp(lp))
        assert r["chosen"] == r["chosenClass"] == (j == chosen_at), (r, token)
    assert p["removed"] == len(top) - len(kept), p
    assert math.isclose(p["prob"], math.exp(logprob), rel_tol=1e-9), (p, logprob)
    chosen = [r for r in p["rows"] if r["chosen"]]
    if token in [t for t, _ in kept]:
        assert len(chosen) == 1 and chosen[0]["token"] == token, p
        assert p["rank"] == str(1 + sum(1 for _, lp in kept if lp > logprob)), p
    else:  # sampled from outside the top k: nothing marked
        assert not chosen and p["rank"] == "", p
    assert sum(r["prob"] for r in p["rows"]) <= 1 + 1e-9, p
    assert all(r["prob"] > 0 for r in p["rows"]), p
    return p


# --- 1. a completion streams; each token's candidates are the API's --------------------------

COMPLETION = dict(temperature=1.0, top_k=0, top_p=0.8, min_p=0, max_tokens=12, seed=5,
                  top_logprobs=10)


def api_completion(server: Server, mode: str, **extra) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "logprobs": COMPLETION["top_logprobs"],
            "logprobs_mode": mode, **{k: v for k, v in COMPLETION.items() if k != "top_logprobs"},
            **extra}
    with server.http() as h:
        r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_completion_tokens_and_candidates(driver, stories):
    d = driver
    open_page(d, stories)
    assert by_id(d, "model").text == "tiny"
    assert by_id(d, "mode-completion").get_attribute("aria-pressed") == "true"
    fill(d, "prompt", PROMPT)
    set_params(d, **COMPLETION, logprobs_mode="processed_logprobs")
    assert generate(d) == "done"

    want = api_completion(stories, "processed_logprobs")
    lp = want["logprobs"]
    assert page_tokens(d) == lp["tokens"]
    assert "".join(lp["tokens"]) == want["text"]
    status = by_id(d, "status")
    assert status.get_attribute("data-tokens") == str(COMPLETION["max_tokens"])
    assert status.get_attribute("data-finish") == want["finish_reason"] == "length"
    assert f"finish_reason {want['finish_reason']}" in status.text
    assert "tokens/s" in status.text

    # top_p < 1 in processed mode: some positions lost candidates to the filter.
    assert any(v <= REMOVED for top in lp["top_logprobs"] for v in top.values()), lp
    # The screenshot's token: best one sampled below rank 1, with candidates removed and
    # 3 or more kept (the earliest such).
    score = {}
    for i, (token, logprob, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"],
                                                  lp["top_logprobs"])):
        click_token(d, i)
        p = assert_panel(d, i, token, logprob, list(top.items()), COMPLETION["top_logprobs"])
        score[i] = (p["rank"] not in ("", "1"), p["removed"] > 0, len(p["rows"]) >= 3, -i)
    interesting = max(score, key=score.get)
    assert score[interesting][:3] == (True, True, True), score

    # Arrow keys move the selection.
    from selenium.webdriver.common.keys import Keys
    click_token(d, 0)
    by_id(d, "output").send_keys(Keys.ARROW_RIGHT)
    assert panel(d)["selected"] == [1]
    by_id(d, "output").send_keys(Keys.ARROW_LEFT, Keys.ARROW_LEFT)
    assert panel(d)["selected"] == [0]

    click_token(d, interesting)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    d.save_screenshot(str(ARTIFACTS / "serve-page.png"))
    set_viewport(d, *SMALL_WINDOW)
    try:
        click_token(d, interesting)
        d.save_screenshot(str(ARTIFACTS / "serve-page-small.png"))
    finally:
        set_viewport(d, *WINDOW)

    # The raw distribution: the same tokens (the seed decides), the model's own softmax.
    set_params(d, logprobs_mode="raw_logprobs")
    assert generate(d) == "done"
    raw = api_completion(stories, "raw_logprobs")["logprobs"]
    assert raw["tokens"] == lp["tokens"] == page_tokens(d)
    click_token(d, interesting)
    p = assert_panel(d, interesting, raw["tokens"][interesting],
                     raw["token_logprobs"][interesting],
                     list(raw["top_logprobs"][interesting].items()), COMPLETION["top_logprobs"])
    assert p["removed"] == 0 and len(p["rows"]) >= COMPLETION["top_logprobs"], p
    assert console_errors(d) == []


# --- 2. the JSON schema box, and chat's error on a model without a template --------------------

def test_json_schema(driver, stories):
    d = driver
    open_page(d, stories)
    fill(d, "prompt", PROMPT)
    params = dict(temperature=0.7, top_k=0, top_p=1, min_p=0, max_tokens=48, seed=5)
    set_params(d, **params, top_logprobs=5, logprobs_mode="processed_logprobs")
    fill(d, "schema", json.dumps(SCHEMA))
    assert generate(d) == "done"
    body = {"model": "tiny", "prompt": PROMPT, **params, "response_format": {
        "type": "json_schema", "json_schema": {"name": "schema", "schema": SCHEMA}}}
    with stories.http() as h:
        r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]
    assert want["finish_reason"] == "stop", want
    text = "".join(page_tokens(d))
    assert text == want["text"]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert by_id(d, "schema-error").text == ""

    # Invalid JSON in the box: a message on the page, and no request.
    d.execute_script("""window.__requests = 0; const f = window.fetch;
                        window.fetch = (...a) => { window.__requests++; return f(...a); };""")
    fill(d, "schema", '{"type": "object",')
    assert generate(d) == "error"
    assert "not valid JSON" in by_id(d, "schema-error").text
    assert "not valid JSON" in by_id(d, "status").text
    assert d.execute_script("return window.__requests") == 0
    assert "".join(page_tokens(d)) == text  # the last output stays

    # Chat on stories260K (no chat template): the server's message is shown.
    fill(d, "schema", "")
    by_id(d, "mode-chat").click()
    fill(d, "prompt", "Hello")
    assert generate(d) == "error"
    with stories.http() as h:
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                "content": "Hello"}]})
    assert r.status_code == 400
    assert by_id(d, "status").text == "Error: " + r.json()["error"]["message"]


# --- 3. --api-key: the page asks for the key --------------------------------------------------

def dialog_open(d) -> bool:
    return d.execute_script("return document.getElementById('key-dialog').open")


def test_api_key(driver, keyed_page_server):
    d, s = driver, keyed_page_server
    open_page(d, s)
    wait(d, lambda: dialog_open(d), "the key dialog")
    assert "needs an API key" in by_id(d, "key-message").text

    fill(d, "api-key", "wrong")
    by_id(d, "key-save").click()
    wait(d, lambda: dialog_open(d) and "refused" in by_id(d, "key-message").text,
         "the dialog to ask again after a wrong key")
    assert d.execute_script("return sessionStorage.getItem('nucleus-api-key')") == "wrong"

    fill(d, "api-key", "page-secret")
    by_id(d, "key-save").click()
    wait(d, lambda: by_id(d, "status").text == "Key accepted.", "the key to be accepted")
    assert not dialog_open(d)
    assert d.execute_script("return sessionStorage.getItem('nucleus-api-key')") == "page-secret"

    fill(d, "prompt", PROMPT)
    params = dict(temperature=1, top_k=0, top_p=1, min_p=0, max_tokens=8, seed=3)
    set_params(d, **params, top_logprobs=3)
    assert generate(d) == "done"
    with s.http(headers={"Authorization": "Bearer page-secret"}) as h:
        r = h.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, **params,
                                            "logprobs": 1})
    assert r.status_code == 200, r.text
    assert page_tokens(d) == r.json()["choices"][0]["logprobs"]["tokens"]

    # A key that stops working: the 401 asks again, and the server's message is shown.
    d.execute_script("sessionStorage.setItem('nucleus-api-key', 'stale')")
    assert generate(d) == "error"
    assert dialog_open(d)
    with s.http() as h:
        message = h.post("/v1/completions", json={"prompt": PROMPT}).json()["error"]["message"]
    assert by_id(d, "status").text == "Error: " + message
    fill(d, "api-key", "page-secret")
    by_id(d, "key-save").click()
    wait(d, lambda: not dialog_open(d), "the dialog to close")
    assert console_errors(d) == []


# --- 4. chat mode keeps the conversation ------------------------------------------------------

def test_chat(driver, qwen3):
    d = driver
    open_page(d, qwen3)
    assert by_id(d, "model").text == "qwen"
    by_id(d, "mode-chat").click()
    assert by_id(d, "mode-chat").get_attribute("aria-pressed") == "true"
    params = dict(temperature=1.5, top_k=40, top_p=0.95, min_p=0, max_tokens=10, seed=11)
    set_params(d, **params, top_logprobs=4, logprobs_mode="processed_logprobs")
    fill(d, "schema", "")
    fill(d, "prompt", "Tell me a story.")
    assert generate(d) == "done"

    with qwen3.http() as h:
        r = h.post("/v1/chat/completions", json={
            "model": "qwen", "messages": [{"role": "user", "content": "Tell me a story."}],
            **params, "logprobs": True, "top_logprobs": 4,
            "logprobs_mode": "processed_logprobs"})
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]
    content = want["logprobs"]["content"]
    assert page_tokens(d) == [e["token"] for e in content]
    history = d.execute_script("""return [...document.querySelectorAll('#history .msg')]
        .map(m => [m.dataset.role, m.querySelector('.content').textContent])""")
    assert history == [["user", "Tell me a story."], ["assistant", want["message"]["content"]]]
    assert by_id(d, "prompt").get_attribute("value") == ""
    click_token(d, 0)
    e = content[0]
    assert_panel(d, 0, e["token"], e["logprob"],
                 [(t["token"], t["logprob"]) for t in e["top_logprobs"]], 4)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    d.save_screenshot(str(ARTIFACTS / "serve-page-chat.png"))
    assert console_errors(d) == []
