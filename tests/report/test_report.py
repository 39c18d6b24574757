"""The run report (rewardbox report) over the record of a real short training run (tiny model, Docker-sandboxed
rewards), clicked through in a real browser: Debian's chromium driven by playwright. A missing chromium or
playwright fails these tests (never skips): scripts/setup.sh installs both.

One reward prints hostile markup for every sample and sometimes raises; everything it printed must appear as text
and nothing of it may run.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import sqlite3
import threading
import urllib.error
import urllib.request

import pytest

from rewardbox import ConfigError
from rewardbox.report.app import RecordError, make_server
from rewardbox.trainer import train
from tests.trainer.test_train import docker_backend, write_reward, write_training_config

HOSTILE = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"><b>bold</b>'
REWARDS = f"""
def shape(prompt, completion, example):
    print("printed for", repr(completion[:20]), {HOSTILE!r})
    return float(len(completion) % 3)

def picky(prompt, completion, example):
    if len(completion) % 4 == 0:
        raise ValueError("picky refuses " + {HOSTILE!r})
    return 1.0
"""
STEPS = 4


def chromium_path() -> str:
    path = os.environ.get("REWARDBOX_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("no chromium: install Debian's chromium package (scripts/setup.sh does), or set "
                    "REWARDBOX_CHROMIUM to a Chromium executable")
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, docker_client, base_image):
    tmp_path = tmp_path_factory.mktemp("report-run")
    source = write_reward(tmp_path, "rewards.py", REWARDS)
    path = write_training_config(tmp_path, base_image, [
        {"name": "shape", "source": source}, {"name": "picky", "source": source, "weight": 0.5}], max_steps=STEPS)
    result = train(path, backend=docker_backend(docker_client, base_image))
    return result.output_dir


@pytest.fixture(scope="module")
def report(run_dir):
    server = make_server(run_dir, "127.0.0.1:0")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright  # the dev extra installs it: missing, this fails

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser, report):
    # The page's Content-Security-Policy (asserted below) would stop injected scripts anyway; bypassed here, so
    # that what keeps hostile text from running is shown to be the page itself (text only), and so that the
    # tests' own waits can evaluate.
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
    opened = context.new_page()
    problems = []
    opened.on("pageerror", lambda e: problems.append(str(e)))
    opened.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    opened.base = report
    yield opened
    context.close()
    assert problems == []


def db(run_dir):
    connection = sqlite3.connect(run_dir / "record.sqlite")
    connection.row_factory = sqlite3.Row
    return connection


def never_ran(page) -> None:
    assert page.evaluate("window.pwned") is None
    assert page.locator("img[src=x]").count() == 0 and page.locator("main script").count() == 0


def test_the_graphs_show_each_step_of_the_run(page, run_dir):
    page.goto(page.base + "/#graphs")
    for chart in ("total", "rewards", "fallbacks", "latency"):
        page.wait_for_selector(f"#chart-{chart} .main-svg")
    traces = page.evaluate("document.getElementById('chart-rewards').data.map(t => [t.name, t.x, t.y])")
    records = db(run_dir)
    for name, steps, means in traces:
        expected = records.execute("SELECT c.step, AVG(s.value) FROM scores s JOIN completions c ON c.id = "
                                   "s.completion_id WHERE s.reward = ? GROUP BY c.step", (name,)).fetchall()
        assert list(zip(steps, means)) == pytest.approx([tuple(row) for row in expected])
    assert sorted(t[0] for t in traces) == ["picky", "shape"]
    total = page.evaluate("document.getElementById('chart-total').data[0].y")
    assert len(total) == STEPS
    fallbacks = page.evaluate("document.getElementById('chart-fallbacks').data.map(t => [t.name, t.y])")
    assert any(name == "picky" and max(rates) > 0 for name, rates in fallbacks)  # its errors
    assert "completions" in page.text_content("#status")


def test_completions_side_by_side_across_steps(page, run_dir):
    records = db(run_dir)
    prompts = records.execute("SELECT COUNT(*) FROM prompts").fetchone()[0]
    page.goto(page.base + "/#completions")
    page.wait_for_selector("#prompt-table tbody tr")
    assert page.locator("#prompt-table tbody tr").count() == prompts
    first = page.locator("#prompt-table tbody tr").first.get_attribute("data-id")
    # search narrows the table to the prompts whose text has it
    word = records.execute("SELECT text FROM prompts WHERE id = ?", (first,)).fetchone()[0].split("What is")[1][:6]
    page.fill("#prompt-search", word)
    page.wait_for_function("document.querySelectorAll('#prompt-table tbody tr').length < %d || %d === 1"
                           % (prompts, prompts))
    ids = [row.get_attribute("data-id") for row in page.locator("#prompt-table tbody tr").all()]
    assert first in ids
    page.fill("#prompt-search", "")
    page.wait_for_function("document.querySelectorAll('#prompt-table tbody tr').length === %d" % prompts)
    # sorting by mean total, both ways
    page.click("#prompt-table th[data-sort=mean_total]")
    page.wait_for_timeout(300)
    ordered = [float(row.locator("td").nth(9).text_content()) for row in page.locator("#prompt-table tbody tr").all()]
    assert ordered == sorted(ordered, reverse=True)
    page.click("#prompt-table th[data-sort=mean_total]")
    page.wait_for_timeout(300)
    ordered = [float(row.locator("td").nth(9).text_content()) for row in page.locator("#prompt-table tbody tr").all()]
    assert ordered == sorted(ordered)
    # one prompt: by default the best completion of its latest step on the right
    pid = page.locator("#prompt-table tbody tr").first.get_attribute("data-id")
    page.locator("#prompt-table tbody tr").first.click()
    page.wait_for_selector("#panel-right h4")
    completions = records.execute("SELECT id, step, text, total FROM completions WHERE prompt_id = ? ORDER BY step, id",
                                  (pid,)).fetchall()
    last = max(c["step"] for c in completions)
    best = max((c for c in completions if c["step"] == last), key=lambda c: c["total"])
    assert f"completion {best['id']}," in page.text_content("#panel-right h4")
    assert page.locator("#detail-table tbody tr").count() == len(completions)
    # the left one moves with the arrows and the slider, through every completion of the prompt
    assert f"completion {completions[0]['id']}," in page.text_content("#panel-left h4")
    page.click("#left-next")
    assert f"completion {completions[1]['id']}," in page.text_content("#panel-left h4")
    page.locator("#left-slider").fill(str(len(completions) - 1))
    assert f"completion {completions[-1]['id']}," in page.text_content("#panel-left h4")
    page.click("#left-prev")
    assert f"completion {completions[-2]['id']}," in page.text_content("#panel-left h4")
    # words that differ are marked; the texts read as they are
    left_text = page.text_content("#panel-left pre")
    assert left_text == completions[-2]["text"]
    if completions[-2]["text"] != best["text"]:
        assert page.locator("#panel-left mark, #panel-right mark").count() > 0
    # each reward's score and status in the panel
    assert page.locator("#panel-right th", has_text="shape").count() == 1
    assert page.locator("#panel-right th", has_text="picky").count() == 1
    never_ran(page)


def test_reward_logs_per_sample_show_hostile_output_as_text(page, run_dir):
    records = db(run_dir)
    page.goto(page.base + "/#logs")
    page.wait_for_selector("#log-table tbody tr")
    page.select_option("#log-reward", "shape")
    page.wait_for_function("[...document.querySelectorAll('#log-table tbody tr td:nth-child(3)')]"
                           ".every(td => td.textContent === 'shape')")
    own = page.locator("#log-table tbody tr").first.locator("td").nth(8).text_content()
    took = page.locator("#log-table tbody tr").first.locator("td").nth(6).text_content()
    assert took != "-" and 0 <= float(took) < 5000  # this sample's own time, in ms
    assert "printed for" in own and HOSTILE in own  # this sample's own print, the markup as text
    page.select_option("#log-reward", "picky")
    page.select_option("#log-status", "error")
    page.wait_for_function("[...document.querySelectorAll('#log-table tbody tr td:nth-child(5)')]"
                           ".every(td => td.textContent === 'error')")
    errors = records.execute("SELECT COUNT(*) FROM scores WHERE reward = 'picky' AND status = 'error'").fetchone()[0]
    assert errors > 0 and f"{errors} scores" in page.text_content("#log-count")
    traceback = page.locator("#log-table tbody tr").first.locator("td").nth(9)
    assert "ValueError: picky refuses " + HOSTILE in traceback.locator("summary").text_content()
    assert "Traceback (most recent call last)" in traceback.locator("pre").text_content()
    page.select_option("#log-reward", "")
    page.select_option("#log-status", "")
    page.fill("#log-search", "bold")
    page.press("#log-search", "Enter")
    page.locator("#log-search").dispatch_event("change")
    page.wait_for_timeout(300)
    assert int(page.text_content("#log-count").split()[0]) > 0
    never_ran(page)


def test_search_signals_and_export(page, run_dir):
    records = db(run_dir)
    page.goto(page.base + "/#search")
    page.wait_for_selector("#signals li")
    page.select_option("#search-reward", "picky")
    page.select_option("#search-status", "error")
    page.click("#search-go")
    errors = records.execute("SELECT COUNT(*) FROM scores WHERE reward = 'picky' AND status = 'error'").fetchone()[0]
    page.wait_for_function(f"document.getElementById('search-count').textContent.startsWith('{errors} completions')")
    rows = page.locator("#search-table tbody tr").count()
    assert rows == min(errors, 50)
    # the export of that view holds the same completions
    href = page.get_attribute("#search-export", "href")
    with urllib.request.urlopen(page.base + href) as response:
        lines = [json.loads(line) for line in response.read().decode().splitlines()]
    assert len(lines) == errors and all(line["scores"]["picky"]["status"] == "error" for line in lines)
    # total above a bound
    page.select_option("#search-reward", "")
    page.select_option("#search-status", "")
    page.fill("#search-min", "1.5")
    page.click("#search-go")
    above = records.execute("SELECT COUNT(*) FROM completions WHERE total >= 1.5").fetchone()[0]
    page.wait_for_function(f"document.getElementById('search-count').textContent.startsWith('{above} completions')")
    # signals: each names its completions, and showing them lists them
    signals = page.locator("#signals li")
    if signals.first.locator("button").count():
        signals.first.locator("button").click()
        page.wait_for_function("document.getElementById('search-count').textContent.includes(\"a signal's\")")
    never_ran(page)


def get(url: str, **headers) -> tuple[int, bytes, dict]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_the_server_is_read_only_loopback_by_default_and_says_what_is_wrong(report, run_dir, tmp_path):
    status, body, headers = get(report + "/api/meta")
    assert status == 200 and json.loads(body)["completions"] > 0
    # a page of another site whose name resolves to 127.0.0.1 (DNS rebinding) sends its own Host: refused
    assert get(report + "/api/export", Host="rebind.example:8050")[0] == 421
    assert get(report + "/api/meta", Host="localhost")[0] == 200
    # parameters it cannot take get a clear error, not a dropped connection
    status, body, _ = get(report + "/api/completions?step=100000000000000000000000&q=" + "%25" * 300)
    assert status == 200 and json.loads(body)["total"] == 0
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    request = urllib.request.Request(report + "/api/meta", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request)
    assert refused.value.code == 405
    with pytest.raises(ConfigError, match="loopback unless a token is set"):
        make_server(run_dir, "0.0.0.0:0")
    with pytest.raises(RecordError, match="no run record"):
        make_server(tmp_path, "127.0.0.1:0")
    (tmp_path / "record.sqlite").write_bytes(b"not a database at all")
    with pytest.raises(RecordError, match="not a readable run record"):
        make_server(tmp_path, "127.0.0.1:0")


def test_a_token_is_required_on_every_request_when_set(run_dir):
    server = make_server(run_dir, "0.0.0.0:0", token="s3cret-token")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert get(base + "/api/meta")[0] == 401
        assert get(base + "/")[0] == 401
        assert get(base + "/api/meta", Authorization="Bearer wrong")[0] == 401
        assert get(base + "/api/meta", Authorization="Bearer s3cret-token")[0] == 200
        # the token in the address once: a cookie of this port, and the address without it
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1])
        connection.request("GET", "/?token=s3cret-token")
        answer = connection.getresponse()
        cookie = answer.getheader("Set-Cookie")
        assert answer.status == 303 and answer.getheader("Location") == "/" and "HttpOnly" in cookie
        connection.close()
        assert get(base + "/api/meta", Cookie=cookie.split(";")[0])[0] == 200
        assert get(base + "/api/meta", Cookie="rewardbox_token_1=s3cret-token")[0] == 401  # another port's
        # any Host is answered with the token; without one, only loopback names are (DNS rebinding)
        assert get(base + "/api/meta", Host="evil.example", Authorization="Bearer s3cret-token")[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_new_steps_appear_without_a_reload(page, run_dir):
    page.goto(page.base + "/#graphs")
    page.wait_for_selector("#chart-total .main-svg")
    before = page.evaluate("document.getElementById('chart-total').data[0].x.length")
    # another rank of the run writes one more step while the page is open
    from types import SimpleNamespace

    from rewardbox.scoring.client import ScoreReport
    from rewardbox.report.record import RunRecorder
    from rewardbox.wire import Status

    recorder = RunRecorder(run_dir / "record.sqlite", [("shape", 1.0), ("picky", 0.5)], num_generations=4, rank=1)
    state = SimpleNamespace(global_step=STEPS + 10, epoch=1.0)
    for name in ("shape", "picky"):
        recorder.observe(name, ScoreReport(name=name, values=[1.0] * 4, statuses=[Status.OK] * 4,
                                           errors=[None] * 4, sample_logs=["late\n"] * 4),
                         state, ["a late prompt"] * 4, ["late"] * 4, {})
    recorder.close()
    page.wait_for_function(f"document.getElementById('chart-total').data[0].x.length === {before + 1}",
                           timeout=10_000)
    assert str(STEPS + 10) in page.text_content("#status")


def test_a_record_of_another_schema_says_so(tmp_path):
    db = sqlite3.connect(tmp_path / "record.sqlite")
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute("INSERT INTO meta VALUES ('schema_version', '0')")
    db.commit()
    db.close()
    with pytest.raises(RecordError, match="schema version 0; this rewardbox reads version 1"):
        make_server(tmp_path, "127.0.0.1:0")


def test_each_completions_tool_calls_are_shown_beside_its_scores_as_text(browser, tmp_path):
    from types import SimpleNamespace

    from rewardbox.scoring.client import ScoreReport
    from rewardbox.report.record import RunRecorder
    from rewardbox.wire import Status

    def turn(*calls):
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}

    conversation = [turn(("run_python", {"code": HOSTILE}), ("add", {"a": 1, "b": 2})),
                    {"role": "tool", "name": "run_python", "content": f"printed {HOSTILE}"},
                    {"role": "tool", "name": "add", "content": "{'error': 'add takes one-digit numbers'}"},
                    {"role": "assistant", "content": "3"}]
    recorder = RunRecorder(tmp_path / "record.sqlite", [("r", 1.0)], num_generations=2)
    recorder.observe("r", ScoreReport(name="r", values=[1.0, 0.0], statuses=[Status.OK] * 2, errors=[None] * 2),
                     SimpleNamespace(global_step=1, epoch=0.0), [[{"role": "user", "content": "What is 1 + 2?"}]] * 2,
                     [conversation, [{"role": "assistant", "content": "4"}]], {})
    recorder.close()
    server = make_server(tmp_path, "127.0.0.1:0")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
    try:
        page = context.new_page()
        page.goto(f"http://127.0.0.1:{server.server_address[1]}/#completions")
        page.wait_for_selector("#prompt-table tbody tr")
        page.locator("#prompt-table tbody tr").first.click()
        page.wait_for_selector("#detail-table tbody tr")
        cells = [row.locator("td").last.text_content() for row in page.locator("#detail-table tbody tr").all()]
        assert sorted(cells) == ["-", "2 (1 failed)"]
        page.locator("#detail-table tbody tr", has_text="2 (1 failed)").click()
        rows = page.locator("#panel-left table.tool-calls tbody tr")
        assert rows.count() == 2
        first, second = (rows.nth(i).locator("td") for i in range(2))
        assert first.nth(0).text_content() == "run_python" and json.dumps(HOSTILE) in first.nth(1).text_content()
        assert first.nth(4).text_content() == f"printed {HOSTILE}" and first.nth(2).text_content() == "ok"
        assert second.nth(2).text_content() == "error"
        never_ran(page)
    finally:
        context.close()
        server.shutdown()
        server.server_close()
