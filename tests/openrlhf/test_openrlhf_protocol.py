"""OpenRLHF's HTTP endpoint without sandboxes: how requests map to rows, and what is refused before scoring (a
stand-in gatherer scores; the server, its sockets and OpenRLHF's own client are real)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestServer

from rewardbox.integrations.openrlhf import ProtocolError, answer, rows
from rewardbox.serve.openrlhf import Endpoint, HttpLimits
from rewardbox.serve.service import ServiceSecurity
from tests.openrlhf.openrlhf_agent import fetch_all, load_agent


def test_the_response_is_the_query_past_its_prompt_and_the_label_is_a_column():
    got = rows(["<s>Q: 2+2?</s>A: 4", "other text"], ["<s>Q: 2+2?</s>", "Q: 3+3?"], ["4", 6])
    assert got == [{"prompt": "<s>Q: 2+2?</s>", "completion": "A: 4", "columns": {"label": "4"}},
                   {"prompt": "Q: 3+3?", "completion": "other text", "columns": {"label": 6}}]
    assert rows(["just a query"]) == [{"prompt": "", "completion": "just a query", "columns": {"label": None}}]


@pytest.mark.parametrize("body, names", [
    ({"query": "one string"}, '"query"'), ({"query": [1]}, '"query"'),
    ({"query": ["a"], "prompts": ["p", "q"]}, '"prompts"'), ({"query": ["a"], "labels": []}, '"labels"'),
])
def test_a_request_outside_the_protocol_is_refused_naming_the_field(body, names):
    with pytest.raises(ProtocolError, match=names):
        rows(body.get("query"), body.get("prompts"), body.get("labels"))


def test_the_answer_lists_totals_and_each_rewards_value_and_fallback_in_query_order():
    results = [{"score": 1.5, "a": 1.0, "a_fallback": 0.0}, {"score": -1.0, "a": -1.0, "a_fallback": 1.0}]
    assert answer(results) == {"rewards": [1.5, -1.0], "scores": [1.5, -1.0],
                               "extra_logs": {"a": [1.0, -1.0], "a_fallback": [0.0, 1.0]}}


class Counting:
    """Scores a row by its label (a stand-in for the sandboxes), and counts what it was given."""

    def __init__(self, hold: asyncio.Event | None = None):
        self.batches, self.rows, self.hold = 0, 0, hold

    async def submit(self, row: dict) -> dict:
        self.rows += 1
        if self.hold is not None:
            await self.hold.wait()
        return {"score": float(row["columns"]["label"]), "r": float(row["columns"]["label"]), "r_fallback": 0.0}


def _endpoint(gatherer, token=None, **limits) -> Endpoint:
    return Endpoint(None, ServiceSecurity(token=token), HttpLimits(**limits), gatherer=gatherer)  # type: ignore


def test_openrlhfs_own_client_gets_each_rollouts_answer():
    agent = load_agent()

    async def run():
        async with TestServer(_endpoint(Counting()).app()) as server:
            executor = agent.SingleTurnAgentExecutor(str(server.make_url("/get_reward")))
            return await fetch_all(executor, [(f"p{i} r{i}", f"p{i}", i) for i in range(20)], "http")

    answers = asyncio.run(run())
    assert [a["rewards"] for a in answers] == [[float(i)] for i in range(20)]
    assert [a["extra_logs"] for a in answers] == [{"r": [float(i)], "r_fallback": [0.0]} for i in range(20)]


def _raw(port: int, head: bytes, body: bytes = b"") -> bytes:
    """What the server answers to a request sent by hand (the body only where given), read until it closes or
    sends a whole short answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 2:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_an_oversized_body_is_refused_on_its_length_before_it_is_sent():
    async def run():
        async with TestServer(_endpoint(Counting(), max_body_bytes=1000).app()) as server:
            head = (b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 10000000000\r\n\r\n")
            return await asyncio.to_thread(_raw, server.port, head)

    reply = asyncio.run(run())  # nothing of the 10 GB body was sent: the answer cannot have waited for it
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"over the limit of 1000" in reply


def test_a_body_without_a_length_is_refused_once_it_passes_the_limit():
    async def run():
        async with TestServer(_endpoint(Counting(), max_body_bytes=1000).app()) as server:
            head = b"POST /get_reward HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            chunk = b"800\r\n" + b"x" * 0x800 + b"\r\n"
            return await asyncio.to_thread(_raw, server.port, head, chunk)

    assert asyncio.run(run()).startswith(b"HTTP/1.1 413")


def test_with_a_token_a_request_without_it_is_refused_and_one_with_it_is_answered():
    async def run():
        async with TestServer(_endpoint(Counting(), token="s3cret").app()) as server:
            body = b'{"query": ["q"], "prompts": [""], "labels": [2]}'
            head = (b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body))
            without = await asyncio.to_thread(_raw, server.port, head + b"\r\n", body)
            wrong = await asyncio.to_thread(_raw, server.port, head + b"Authorization: Bearer nope\r\n\r\n", body)
            right = await asyncio.to_thread(_raw, server.port, head + b"Authorization: Bearer s3cret\r\n\r\n", body)
            return without, wrong, right

    without, wrong, right = asyncio.run(run())
    assert without.startswith(b"HTTP/1.1 401") and wrong.startswith(b"HTTP/1.1 401")
    assert right.startswith(b"HTTP/1.1 200") and b'"rewards": [2.0]' in right


def test_bad_json_gets_400_naming_the_problem():
    async def run():
        async with TestServer(_endpoint(Counting()).app()) as server:
            body = b'{"query": ["q"'
            head = b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
            return await asyncio.to_thread(_raw, server.port, head, body)

    reply = asyncio.run(run())
    assert reply.startswith(b"HTTP/1.1 400") and b"not JSON" in reply


def test_requests_past_the_in_flight_limit_are_refused_at_once_and_the_rest_answered():
    async def run():
        hold = asyncio.Event()
        gatherer = Counting(hold)
        async with TestServer(_endpoint(gatherer, max_in_flight=3).app()) as server:
            import aiohttp

            async with aiohttp.ClientSession() as session:
                async def post(i):
                    async with session.post(server.make_url("/get_reward"),
                                            json={"query": ["q"], "prompts": [""], "labels": [i]}) as r:
                        return r.status, await r.json()

                tasks = [asyncio.ensure_future(post(i)) for i in range(5)]
                for _ in range(1000):  # the three that fit are held by the gatherer
                    if gatherer.rows >= 3:
                        break
                    await asyncio.sleep(0.01)
                refused = [await t for t in tasks if await _done_soon(t)]
                hold.set()
                return refused, [await t for t in tasks]

    refused, done = asyncio.run(run())
    assert sorted(status for status, _ in done) == [200, 200, 200, 503, 503]
    assert len(refused) == 2 and all(status == 503 for status, _ in refused)
    assert all("in flight" in body["error"] for status, body in done if status == 503)


async def _done_soon(task) -> bool:
    await asyncio.wait([task], timeout=2)
    return task.done()


def test_a_non_loopback_address_without_tls_and_a_token_is_refused_before_anything_starts(tmp_path):
    config = tmp_path / "rewardbox.yaml"
    config.write_text("rewards: [{source: nowhere.py}]\n")
    done = subprocess.run([sys.executable, "-m", "rewardbox.cli", "serve", str(config), "--openrlhf", "0.0.0.0:8123"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    said = " ".join((done.stdout + done.stderr).split())
    assert "--openrlhf 0.0.0.0:8123" in said and "TLS" in said and "token" in said and "127.0.0.1" in said




def test_calls_close_together_are_one_batch_a_lone_call_waits_the_gap_and_a_wave_no_longer_than_the_window(
        monkeypatch):
    from rewardbox.integrations import batching

    seen: list = []

    async def score_rows(sandboxes, rows):
        seen.append((asyncio.get_running_loop().time(), len(rows)))
        return [{"score": 0.0} for _ in rows]

    monkeypatch.setattr(batching, "score_rows", score_rows)

    async def run():
        loop = asyncio.get_running_loop()
        gatherer = batching.Gatherer(None, window_s=1.0, gap_s=0.3)  # type: ignore[arg-type]
        t0 = loop.time()
        await gatherer.submit({})  # alone: the gap, not the window
        lone = seen[-1][0] - t0

        async def trickle(n: int, every_s: float):  # one call every every_s
            tasks = []
            for _ in range(n):
                tasks.append(asyncio.ensure_future(gatherer.submit({})))
                await asyncio.sleep(every_s)
            await asyncio.gather(*tasks)

        seen.clear()
        await trickle(5, 0.01)  # well inside the gap: one batch
        together = [n for _, n in seen]
        seen.clear()
        start = loop.time()
        await trickle(30, 0.05)  # a wave longer than the window: cut at the window
        return lone, together, [(t - start, n) for t, n in seen], gatherer.batches

    lone, together, wave, batches = asyncio.run(run())
    assert 0.3 <= lone < 0.95, lone  # a timer never fires early; late by 0.65 s only on a machine far past busy
    assert together == [5]
    assert sum(n for _, n in wave) == 30 and len(wave) >= 2
    assert wave[0][0] < 1.3, wave  # the first batch went at the window, though calls kept coming
    assert batches == 1 + 1 + len(wave)


def _serve_tls(security, requests):
    """Runs ``requests(port)`` (a coroutine function) against the endpoint served with ``security``'s TLS."""
    from aiohttp import web

    from rewardbox.serve.openrlhf import ssl_context

    async def run():
        runner = web.AppRunner(_endpoint(Counting(), token=security.token).app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context(security))
        await site.start()
        try:
            return await requests(runner.addresses[0][1])
        finally:
            await runner.cleanup()

    return asyncio.run(run())


def test_over_tls_with_a_token_a_trainer_that_trusts_the_ca_and_sends_the_token_is_answered(tmp_path):
    import ssl

    import aiohttp
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    security = ServiceSecurity(certificate=b"".join(b.bytes() for b in server.cert_chain_pems),
                               private_key=server.private_key_pem.bytes(), token="s3cret")
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    body = {"query": ["q"], "prompts": [""], "labels": [3]}

    async def requests(port):
        async with aiohttp.ClientSession() as session:
            url = f"https://127.0.0.1:{port}/get_reward"
            async with session.post(url, json=body, ssl=trusted,
                                    headers={"Authorization": "Bearer s3cret"}) as r:
                good = r.status, await r.json()
            async with session.post(url, json=body, ssl=trusted) as r:
                no_token = r.status
            try:
                async with session.post(url, json=body, headers={"Authorization": "Bearer s3cret"}) as r:
                    untrusted = r.status
            except aiohttp.ClientConnectorCertificateError:
                untrusted = "refused"
            try:
                async with session.post(f"http://127.0.0.1:{port}/get_reward", json=body) as r:
                    plaintext = r.status
            except aiohttp.ClientError:
                plaintext = "refused"
            return good, no_token, untrusted, plaintext

    good, no_token, untrusted, plaintext = _serve_tls(security, requests)
    assert good == (200, {"rewards": [3.0], "scores": [3.0], "extra_logs": {"r": [3.0], "r_fallback": [0.0]}})
    assert no_token == 401 and untrusted == "refused" and plaintext == "refused"


def test_with_a_client_ca_a_peer_without_a_client_certificate_is_refused_in_the_handshake():
    import ssl

    import aiohttp
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    clients = trustme.CA()
    security = ServiceSecurity(certificate=b"".join(b.bytes() for b in server.cert_chain_pems),
                               private_key=server.private_key_pem.bytes(), token="t",
                               client_ca=clients.cert_pem.bytes())
    bare, with_cert = ssl.create_default_context(), ssl.create_default_context()
    ca.configure_trust(bare)
    ca.configure_trust(with_cert)
    clients.issue_cert("trainer").configure_cert(with_cert)
    body = {"query": ["q"], "prompts": [""], "labels": [1]}

    async def requests(port):
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer t"}) as session:
            url = f"https://127.0.0.1:{port}/get_reward"
            try:
                async with session.post(url, json=body, ssl=bare) as r:
                    without = r.status
            except aiohttp.ClientError:
                without = "refused"
            async with session.post(url, json=body, ssl=with_cert) as r:
                return without, r.status

    assert _serve_tls(security, requests) == ("refused", 200)


def _post_raw(body: bytes, **limits) -> bytes:
    async def run():
        async with TestServer(_endpoint(Counting(), **limits).app()) as server:
            head = b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
            return await asyncio.to_thread(_raw, server.port, head, body)

    return asyncio.run(run())


def test_json_nested_past_the_parsers_depth_gets_400_not_500():
    reply = _post_raw(b"[" * 200_000 + b"]" * 200_000, max_body_bytes=1 << 20)
    assert reply.startswith(b"HTTP/1.1 400") and b"RecursionError" in reply


def test_a_request_of_more_rollouts_than_the_limit_gets_400_naming_it():
    import json

    body = json.dumps({"query": ["q"] * 11, "prompts": [""] * 11, "labels": [1] * 11}).encode()
    reply = _post_raw(body, max_rollouts=10)
    assert reply.startswith(b"HTTP/1.1 400") and b"over the limit of 10" in reply


def test_requests_past_the_bytes_in_flight_are_refused_at_once():
    import json

    size = len(json.dumps({"query": ["q" * 40], "prompts": [""], "labels": [0]}))  # each request's, i < 10
    limit = 4 * size + size // 2

    async def run():
        hold = asyncio.Event()
        gatherer = Counting(hold)
        async with TestServer(_endpoint(gatherer, max_in_flight_bytes=limit).app()) as server:
            import aiohttp

            async with aiohttp.ClientSession() as session:
                async def post(i):
                    body = {"query": ["q" * 40], "prompts": [""], "labels": [i]}
                    async with session.post(server.make_url("/get_reward"), json=body) as r:
                        return r.status, await r.json()

                tasks = [asyncio.ensure_future(post(i)) for i in range(8)]
                for _ in range(1000):  # the four that fit are held by the gatherer; the rest refused meanwhile
                    if gatherer.rows >= 4:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)
                hold.set()
                return [await t for t in tasks]

    done = asyncio.run(run())
    assert sorted(status for status, _ in done) == [200] * 4 + [503] * 4
    assert all(f"the limit of {limit}" in body["error"] for status, body in done if status == 503)


# -- what the red team of #44 broke (docs/security-log.md), each a test that failed before its fix ----------------

def _listening_endpoint(gatherer, requests, **limits):
    """Runs ``requests(port)`` against the endpoint as ``rewardbox serve --openrlhf`` serves it (its connection
    gate and aiohttp's limits included)."""
    from rewardbox.serve.openrlhf import listening

    async def run():
        async with listening(_endpoint(gatherer, **limits), "127.0.0.1", 0) as port:
            return await requests(port)

    return asyncio.run(run())


def test_a_lone_surrogate_gets_400_naming_the_field_and_fails_no_other_request_of_its_batch(monkeypatch):
    from rewardbox.integrations import batching
    from rewardbox.integrations.openrlhf import score

    with pytest.raises(ProtocolError, match=r'"query"\[0\] is not valid Unicode'):
        rows(["P \ud800 x"], ["P "], ["l"])
    with pytest.raises(ProtocolError, match=r'"prompts"\[0\]'):
        rows(["x"], ["\udfff"], ["l"])

    async def score_rows(sandboxes, rows_):  # as build_samples does with a row the wire cannot carry
        for row in rows_:
            if row["completion"] == "bad":
                raise ValueError("a row no sandbox can take")
        return [{"score": float(len(row["completion"]))} for row in rows_]

    monkeypatch.setattr(batching, "score_rows", score_rows)

    async def run():
        gatherer = batching.Gatherer(None)  # type: ignore[arg-type]
        calls = [score(gatherer, [q], [""], [None]) for q in ("a", "bb", "bad", "dddd")]
        return await asyncio.gather(*calls, return_exceptions=True), gatherer.batches

    results, batches = asyncio.run(run())
    assert [r["rewards"] for r in results if isinstance(r, dict)] == [[1.0], [2.0], [4.0]]
    assert isinstance(results[2], ValueError)
    assert batches == 1  # one batch, then each row alone once it failed


def test_an_authorization_header_that_is_not_utf8_gets_401_not_500():
    async def run():
        async with TestServer(_endpoint(Counting(), token="s3cret").app()) as server:
            body = b'{"query": ["q"], "prompts": [""], "labels": [2]}'
            head = (b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                    b"Authorization: Bearer \xff\xfe\r\n\r\n" % len(body))
            return await asyncio.to_thread(_raw, server.port, head, body)

    assert asyncio.run(run()).startswith(b"HTTP/1.1 401")


def test_connections_that_declare_large_bodies_and_send_nothing_hold_no_bytes_and_time_out():
    def idle(port: int) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n")
        return s

    async def requests(port):
        idlers = [await asyncio.to_thread(idle, port) for _ in range(4)]  # 3,600 bytes declared, 0 sent
        body = b'{"query": ["q"], "prompts": [""], "labels": [5]}'
        head = b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        answered = await asyncio.to_thread(_raw, port, head, body)
        timed_out = await asyncio.to_thread(lambda: idlers[0].recv(65536))  # its body never came
        for s in idlers:
            s.close()
        return answered, timed_out

    answered, timed_out = _listening_endpoint(Counting(), requests, max_in_flight_bytes=1000, body_timeout_s=1.0)
    assert answered.startswith(b"HTTP/1.1 200") and b'"rewards": [5.0]' in answered
    assert timed_out.startswith(b"HTTP/1.1 408")


def _slow(port: int) -> socket.socket:
    """A connection whose headers never end."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4000)
    return s


def _keep_alive(port: int, token: str = "") -> socket.socket:
    """A kept-alive connection that has had one request answered (with ``token``, where given)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
    s.sendall(b"GET /stats HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
    assert s.recv(65536).split(b" ", 2)[1] in (b"200", b"401")
    return s


def test_a_connection_whose_headers_never_end_is_closed_and_at_the_cap_the_oldest_such_makes_room():
    async def requests(port):
        slow_ones = [await asyncio.to_thread(_slow, port) for _ in range(3)]
        newest = await asyncio.to_thread(_slow, port)  # at the cap: the oldest unserved one goes
        evicted = await asyncio.to_thread(_closed, slow_ones[0])
        timed_out = await asyncio.to_thread(_closed, slow_ones[1])  # after first_request_s
        for s in (*slow_ones, newest):
            s.close()
        body = b'{"query": ["q"], "prompts": [""], "labels": [1]}'
        head = b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        await asyncio.sleep(0.1)  # the closed ones' places are free again
        return evicted, timed_out, await asyncio.to_thread(_raw, port, head, body)

    evicted, timed_out, answered = _listening_endpoint(Counting(), requests, max_connections=3, first_request_s=1.0)
    assert evicted and timed_out
    assert answered.startswith(b"HTTP/1.1 200")


def test_requests_without_the_token_keep_no_connection_and_authorised_ones_keep_theirs_at_the_cap():
    async def requests(port):
        unauthorised = [await asyncio.to_thread(_keep_alive, port) for _ in range(2)]  # 401, then idle
        authorised = [await asyncio.to_thread(_keep_alive, port, "t") for _ in range(2)]
        gone = await asyncio.to_thread(_closed, unauthorised[0])  # made room for the authorised ones
        third = await asyncio.to_thread(_keep_alive, port, "t")  # the cap: 3, the last unauthorised one goes
        gone_too = await asyncio.to_thread(_closed, unauthorised[1])
        past = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 10)
        refused = await asyncio.to_thread(_closed, past)  # every one left is authorised: the new one goes
        await asyncio.sleep(1.5)  # past first_request_s: the authorised ones stay
        kept = [await asyncio.to_thread(_keep_alive_again, s) for s in (*authorised, third)]
        for s in (*unauthorised, *authorised, third, past):
            s.close()
        return gone, gone_too, refused, kept

    gone, gone_too, refused, kept = _listening_endpoint(Counting(), requests, token="t", max_connections=3,
                                                        first_request_s=1.0)
    assert gone and gone_too and refused
    assert kept == [True, True, True]


def _keep_alive_again(s: socket.socket) -> bool:
    s.sendall(b"GET /stats HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\n\r\n")
    return s.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_tls_handshake_that_never_ends_is_closed_and_frees_its_place():
    import trustme

    from rewardbox.serve.openrlhf import listening, ssl_context

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    security = ServiceSecurity(certificate=b"".join(b.bytes() for b in server.cert_chain_pems),
                               private_key=server.private_key_pem.bytes())

    async def run():
        endpoint = _endpoint(Counting(), max_connections=2, first_request_s=0.5, handshake_s=0.5)
        async with listening(endpoint, "127.0.0.1", 0, ssl_context(security)) as port:
            stuck = [await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 10) for _ in range(5)]
            for s in stuck[:2]:
                s.sendall(b"\x16\x03\x01\x00")  # a ClientHello that never ends
            held = endpoint.connections.open
            closed = [await asyncio.to_thread(_closed, s) for s in stuck]
            await asyncio.sleep(0.6)
            left = endpoint.connections.open
            for s in stuck:
                s.close()
            return held, closed, left

    held, closed, left = asyncio.run(run())
    assert held <= 2  # counted from the accept, the handshake included
    assert all(closed) and left == 0


def _closed(s: socket.socket) -> bool:
    """Whether the server closed (or reset) the connection, within the socket's timeout."""
    try:
        return s.recv(10) == b""
    except ConnectionResetError:
        return True
