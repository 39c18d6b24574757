"""``rewardbox serve`` and ``backend: remote`` on loopback: real services (separate processes), real gRPC with TLS
and a token, real sandboxes behind them."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from typer.testing import CliRunner

from rewardbox import BackendError, ConfigError, RewardLoadError, build_samples
from rewardbox.cli import app
from rewardbox.wire.pb import reward_pb2 as pb
from rewardbox.wire.pb import reward_pb2_grpc as pb_grpc
from tests.remote.conftest import TOKEN

EXACT = """
import os, time

def exact(prompt, completion, example):
    time.sleep(0.02)
    print("who=" + os.environ.get("WHO", "?"))
    return len(completion) * 0.5 + int(prompt)
"""

COUNTED = """
import fcntl, os, time

def _update(delta):
    with open(os.path.join(os.environ["COUNT_DIR"], "count"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        now, peak = (list(map(int, f.read().split())) or [0, 0])
        now += delta
        f.seek(0)
        f.truncate()
        f.write(f"{now} {max(peak, now)}")

def counted(prompt, completion, example):
    _update(1)
    try:
        time.sleep(0.15)
    finally:
        _update(-1)
    return float(prompt)
"""


def batch(start: int, n: int):
    prompts = [str(i) for i in range(start, start + n)]
    completions = ["x" * (i % 7) for i in range(start, start + n)]
    return build_samples(prompts, completions, {}), [len(c) * 0.5 + int(p) for p, c in zip(prompts, completions)]


def test_samples_spread_over_two_tls_services_and_none_is_lost_when_one_is_killed(serve, client, certs):
    a = serve([{"name": "exact", "code": EXACT, "env": {"WHO": "a"}}], tls=certs, token=TOKEN, name="a")
    b = serve([{"name": "exact", "code": EXACT, "env": {"WHO": "b"}}], tls=certs, token=TOKEN, name="b")
    s = client([{"name": "exact", "code": EXACT}], [a.target, b.target], tls_ca=certs.ca, token=TOKEN)
    assert [r.name for r in s.replicas["exact"]] == [f"exact@{a.target}", f"exact@{b.target}"]

    batches = [batch(64 * k, 64) for k in range(6)]  # 384 samples, several seconds of work for the two services
    killed_at = []

    def kill_a():
        time.sleep(1.0)
        a.kill()
        killed_at.append(time.monotonic())

    async def score_all():
        return await asyncio.gather(*(s["exact"].client.score(samples) for samples, _ in batches[1:]))

    # The first batch before the kill, split over both services: each sample in a process of its own (isolation:
    # sample on the local backend), five batches in flight at once would leave a none finished by the kill.
    first = asyncio.run(s["exact"].client.score(batches[0][0]))
    killer = threading.Thread(target=kill_a)
    killer.start()
    reports = [first] + asyncio.run(score_all())
    finished = time.monotonic()
    killer.join()

    assert killed_at and killed_at[0] < finished, "service a must die while samples are being scored"
    for report, (_, expected) in zip(reports, batches):
        assert report.statuses == ["ok"] * 64, [e for e in report.errors if e]
        assert report.values == expected
    logs = "".join(r.logs for r in reports)
    assert "who=a" in logs and "who=b" in logs  # both served until a died
    assert s.replicas["exact"][0].down_since is not None  # a is set aside; b took over its samples


def test_wrong_token_missing_token_and_plaintext_to_tls_fail_at_start_naming_the_problem(serve, client, certs):
    a = serve([{"name": "exact", "code": EXACT}], tls=certs, token=TOKEN)
    reward = [{"name": "exact", "code": EXACT}]
    with pytest.raises(BackendError, match=r"refused the token in \$RBX_TEST_TOKEN"):
        client(reward, [a.target], tls_ca=certs.ca, token="not-the-token", name="c1")
    with pytest.raises(BackendError, match=r"requires a token, and none is sent: set sandbox.remote.token_env"):
        client(reward, [a.target], tls_ca=certs.ca, name="c2")
    with pytest.raises(BackendError, match=r"not plaintext gRPC: the service probably uses TLS; set "
                                           r"sandbox.remote.tls_ca"):
        client(reward, [a.target], token=TOKEN, name="c3")
    with pytest.raises(BackendError, match=r"TLS handshake failed: check that sandbox.remote.tls_ca is the CA"):
        client(reward, [a.target], tls_ca=certs.other_ca, token=TOKEN, name="c4")
    with pytest.raises(ConfigError, match=r"sandbox.remote.tls_ca: cannot read .*missing.pem"):
        client(reward, [a.target], tls_ca=certs.ca.parent / "missing.pem", token=TOKEN, name="c5")
    with pytest.raises(ConfigError, match=r"reward 'other': no endpoint serves it"):
        client([*reward, {"name": "other", "code": EXACT.replace("def exact", "def other")}], [a.target],
               tls_ca=certs.ca, token=TOKEN, name="c6")
    assert "a client loaded" not in "".join(a.output)  # nothing got as far as loading, let alone scoring


def test_a_service_with_a_client_ca_serves_only_clients_with_its_certificates(serve, client, certs):
    a = serve([{"name": "exact", "code": EXACT}], tls=certs, token=TOKEN, mutual=True)
    assert "(mutual TLS, token)" in "".join(a.output)
    reward = [{"name": "exact", "code": EXACT}]
    s = client(reward, [a.target], tls_ca=certs.ca, token=TOKEN, tls_client_cert=str(certs.client_cert),
               tls_client_key=str(certs.client_key), name="ok")
    samples, expected = batch(0, 8)
    report = asyncio.run(s["exact"].client.score(samples))
    assert report.statuses == ["ok"] * 8 and report.values == expected
    with pytest.raises(BackendError, match=r"requires client certificates \(`rewardbox serve --tls-client-ca`\)\. "
                                           r"Set sandbox.remote.tls_client_cert and tls_client_key"):
        client(reward, [a.target], tls_ca=certs.ca, token=TOKEN, name="none")
    with pytest.raises(BackendError, match=r"refused the client certificate .*other-client.pem in the TLS handshake"):
        client(reward, [a.target], tls_ca=certs.ca, token=TOKEN, tls_client_cert=str(certs.other_client_cert),
               tls_client_key=str(certs.other_client_key), name="other")
    with pytest.raises(ConfigError, match=r"tls_client_cert and tls_client_key go together"):
        client(reward, [a.target], tls_ca=certs.ca, token=TOKEN, tls_client_cert=str(certs.client_cert), name="half")
    # the certificate is not instead of the token: both are checked
    with pytest.raises(BackendError, match=r"requires a token, and none is sent"):
        client(reward, [a.target], tls_ca=certs.ca, tls_client_cert=str(certs.client_cert),
               tls_client_key=str(certs.client_key), name="no-token")


def test_tls_client_against_a_plaintext_service_names_the_problem(serve, client, certs):
    a = serve([{"name": "exact", "code": EXACT}])
    with pytest.raises(BackendError, match=r"speaks plaintext, not TLS"):
        client([{"name": "exact", "code": EXACT}], [a.target], tls_ca=certs.ca)


def test_the_token_is_checked_on_every_rpc_health_and_reflection_included(serve, certs):
    a = serve([{"name": "exact", "code": EXACT}], tls=certs, token=TOKEN)
    credentials = grpc.ssl_channel_credentials(certs.ca.read_bytes())
    reflect = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.secure_channel(a.target, credentials) as channel:
        calls = {
            "health": lambda md: health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10, metadata=md),
            "reflection": lambda md: list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflect]), timeout=10, metadata=md)),
            "score": lambda md: pb_grpc.RewardSandboxStub(channel).Score(
                pb.ScoreRequest(function="exact", samples=batch(0, 1)[0]), timeout=10, metadata=md),
            "load": lambda md: pb_grpc.RewardSandboxStub(channel).Load(pb.LoadRequest(), timeout=10, metadata=md),
        }
        for name, call in calls.items():
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
                with pytest.raises(grpc.RpcError) as refused:
                    call(metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        good = (("authorization", f"Bearer {TOKEN}"),)
        assert calls["health"](good).status == health_pb2.HealthCheckResponse.SERVING
        services = calls["reflection"](good)[0].list_services_response.service
        assert "rewardbox.v1.RewardSandbox" in {s.name for s in services}
        assert calls["score"](good).scores[0].value == 0.0


def test_max_in_flight_holds_for_all_clients_together_as_the_reward_itself_observes(serve, client, tmp_path):
    counted = {"name": "counted", "code": COUNTED, "workers": 4}
    figures = {}
    for name, budget in (("limited", {"max_in_flight": 3}), ("unlimited", {})):
        folder = tmp_path / f"count-{name}"
        folder.mkdir()
        service = serve([{**counted, "env": {"COUNT_DIR": str(folder)}, **budget}], name=name)
        ranks = [client([{"name": "counted", "code": COUNTED}], [service.target], name=f"{name}-rank{i}")
                 for i in range(2)]

        async def both():
            return await asyncio.gather(*(rank["counted"].client.score(
                build_samples([str(i) for i in range(24)], ["c"] * 24, {})) for rank in ranks))

        reports = asyncio.run(both())
        for report in reports:
            assert report.statuses == ["ok"] * 24 and report.values == [float(i) for i in range(24)]
        now, peak = map(int, (folder / "count").read_text().split())
        figures[name] = (now, peak)
    assert figures["limited"] == (0, 3)  # never more than 3 at once, and the budget was used
    assert figures["unlimited"][1] > 3  # without it, the same load runs more at once


def test_a_reward_edited_mid_run_is_reloaded_remotely_for_every_client(serve, client, tmp_path):
    v1 = "def versioned(prompt, completion, example):\n    return 1.0\n"
    service = serve([{"name": "versioned", "code": v1}])
    rank0 = client([{"name": "versioned", "code": v1}], [service.target], name="rank0")
    rank1 = client([{"name": "versioned", "code": v1}], [service.target], name="rank1")
    samples = build_samples(["p"] * 3, ["a", "b", "c"], {})
    assert asyncio.run(rank0["versioned"].client.score(samples)).values == [1.0] * 3
    assert "a client loaded a new version" not in "".join(service.output)  # same source at start: no reload

    source = tmp_path / "rank0" / "rewards" / "versioned.py"
    source.write_text(v1.replace("1.0", "2.0"))
    rank0.reload("versioned")
    assert asyncio.run(rank0["versioned"].client.score(samples)).values == [2.0] * 3
    assert asyncio.run(rank1["versioned"].client.score(samples)).values == [2.0] * 3  # one service, one version

    source.write_text("def versioned(prompt, completion, example):\n    return (\n")
    with pytest.raises(RewardLoadError, match=r"versioned\.py:2: SyntaxError"):
        rank0.reload("versioned")
    assert asyncio.run(rank1["versioned"].client.score(samples)).values == [2.0] * 3  # the last good one serves


def test_a_draining_service_sends_its_clients_elsewhere(serve, client):
    import signal

    a = serve([{"name": "exact", "code": EXACT, "env": {"WHO": "a"}}], name="a")
    b = serve([{"name": "exact", "code": EXACT, "env": {"WHO": "b"}}], name="b")
    s = client([{"name": "exact", "code": EXACT}], [a.target, b.target])
    a.kill(signal.SIGTERM)
    assert "draining" in "".join(a.output) and "stopped; all sandboxes were removed" in "".join(a.output)
    samples, expected = batch(0, 64)
    report = asyncio.run(s["exact"].client.score(samples))
    assert report.statuses == ["ok"] * 64 and report.values == expected
    assert "who=b" in report.logs and "who=a" not in report.logs


def test_serve_refuses_a_reachable_address_without_tls_and_a_token(tmp_path, monkeypatch):
    monkeypatch.delenv("REWARDBOX_TOKEN", raising=False)
    (tmp_path / "r.py").write_text("def r(prompt, completion, example):\n    return 1.0\n")
    (tmp_path / "c.yaml").write_text("sandbox: {backend: local}\nrewards: [{name: r, source: r.py}]\n")
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "c.yaml"), "--listen", "0.0.0.0:50999"])
    assert result.exit_code == 2
    assert "needs TLS (--tls-cert and --tls-key) and a token (export REWARDBOX_TOKEN=...)" in result.output
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "c.yaml"), "--listen", "0.0.0.0:50999",
                                      "--tls-cert", str(tmp_path / "r.py")])
    assert result.exit_code == 2 and "--tls-cert and --tls-key go together" in result.output
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "c.yaml"), "--listen", "127.0.0.1:50999",
                                      "--tls-client-ca", str(tmp_path / "r.py")])
    assert result.exit_code == 2 and "--tls-client-ca needs TLS: give --tls-cert and --tls-key too" in result.output
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "c.yaml"), "--listen", "127.0.0.1:50999",
                                      "--tls-cert", str(tmp_path / "r.py"), "--tls-key", str(tmp_path / "r.py"),
                                      "--tls-client-ca", str(tmp_path / "r.py")])
    assert result.exit_code == 2 and "r.py: not a PEM certificate" in result.output


ADD = """
def add(a: int, b: int) -> dict:
    \"\"\"Adds two numbers.

    Args:
        a: the first number
        b: the second number
    \"\"\"
    if a > 9:
        raise ValueError("one-digit numbers only")
    return {"sum": a + b, "parts": [a, b]}
"""


def test_tools_served_by_a_shared_service_return_what_they_return_in_process(serve, monkeypatch):
    # The service once put a tool's result where a score goes (a float): every call failed as unavailable.
    from rewardbox import ToolError, sandboxed_tools
    from tests.remote.conftest import TOKEN_ENV

    service = serve([{"name": "add", "code": ADD, "style": "tool"}], token=TOKEN)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    namespace: dict = {}
    exec(ADD, namespace)
    remote = {"endpoints": [service.target], "token_env": TOKEN_ENV}
    with sandboxed_tools([namespace["add"]], sandbox={"backend": "remote", "remote": remote}) as tools:
        assert asyncio.run(tools[0](a=1, b=2)) == namespace["add"](a=1, b=2) == {"sum": 3, "parts": [1, 2]}
        with pytest.raises(ToolError, match="^one-digit numbers only$"):
            asyncio.run(tools[0](a=10, b=2))


COUNTER = """
import os


class Counter:
    def __init__(self):
        self.n = 0

    def reset(self, start: int = 0, **kwargs) -> str:
        self.n = start
        return f"from {start}"

    def bump(self, by: int) -> dict:
        \"\"\"Adds to the counter.

        Args:
            by: how much to add
        \"\"\"
        self.n += by
        return {"n": self.n, "pid": os.getpid()}

    def get_reward(self) -> float:
        return float(self.n)
"""


@contextlib.contextmanager
def _counter_served(serve, monkeypatch, workers: int, max_episodes: int, replicas: int = 1, extra: tuple = ()):
    """A service serving COUNTER as an environment (``workers`` episodes per replica), and a trainer's factory of
    its proxies through the remote backend."""
    from rewardbox import sandboxed_environment
    from tests.remote.conftest import TOKEN_ENV

    service = serve([{"name": "Counter", "code": COUNTER, "function": "Counter", "style": "environment",
                      "isolation": "worker", "workers": workers, "replicas": replicas}], token=TOKEN, extra=extra)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    namespace: dict = {}
    exec(COUNTER, namespace)
    remote = {"endpoints": [service.target], "token_env": TOKEN_ENV}
    with sandboxed_environment(namespace["Counter"], sandbox={"backend": "remote", "remote": remote},
                               max_episodes=max_episodes) as factory:
        yield factory


def test_environments_served_by_a_shared_service_keep_each_episode_on_the_process_that_holds_it(serve, monkeypatch):
    # two replicas behind the service: an episode's calls must reach the one holding it
    with _counter_served(serve, monkeypatch, workers=4, max_episodes=4, replicas=2) as factory:
        instances = [factory() for _ in range(4)]
        for round_ in range(3):
            assert [env.reset(start=10 * i) for i, env in enumerate(instances)] == [f"from {10 * i}" for i in range(4)]

            async def calls():
                return await asyncio.gather(*(env.bump(by=k) for env in instances for k in (1, 2, 3)))

            results = asyncio.run(calls())
            for i in range(4):  # each episode's calls in order, in one process
                mine = results[3 * i:3 * i + 3]
                assert [r["n"] for r in mine] == [10 * i + 1, 10 * i + 3, 10 * i + 6]
                assert len({r["pid"] for r in mine}) == 1
            assert len({r["pid"] for r in results}) == 4  # each its own
            assert [env.get_reward() for env in instances] == [10.0 * i + 6 for i in range(4)]


def test_a_service_ends_episodes_left_idle_by_a_trainer_that_went_away(serve, monkeypatch):
    from rewardbox import ToolError

    with _counter_served(serve, monkeypatch, workers=2, max_episodes=2, extra=("--episode-idle-s", "1")) as factory:
        gone, other = factory(), factory()
        gone.reset()
        first = asyncio.run(gone.bump(by=1))
        time.sleep(1.5)
        other.reset()  # the service ends what idled past 1 s, freeing its process for the next episode
        with pytest.raises(ToolError, match="holds no live episode of that id"):
            asyncio.run(gone.bump(by=1))
        assert gone.reset(start=5) == "from 5"
        again = asyncio.run(gone.bump(by=1))
        assert again["n"] == 6 and again["pid"] != first["pid"]


def test_a_hostile_tenants_raw_episode_requests_leave_no_process_the_service_cannot_end(serve):
    # Red teams (docs/security-log.md): a restart of a live id moved or dropped its entry, an end named for another
    # environment dropped that one's, a start and an end of one id racing each other, an end the sandbox refused
    # and a start its client gave up on left a process no entry named, and a new trainer's Load restarted every
    # trainer's live episodes. Each leaked process held a slot for
    # good: the idle sweep ends only what the map names. Afterwards every slot must be free again.
    import concurrent.futures
    import json
    import uuid

    other = COUNTER.replace("class Counter", "class Other")
    service = serve([{"name": "Counter", "code": COUNTER, "function": "Counter", "style": "environment",
                      "isolation": "worker", "workers": 2, "replicas": 2},
                     {"name": "Other", "code": other, "function": "Other", "style": "environment",
                      "isolation": "worker", "workers": 1}],
                    token=TOKEN, extra=("--episode-idle-s", "1"))
    channel = grpc.insecure_channel(service.target)
    stub = pb_grpc.RewardSandboxStub(channel)
    metadata = (("authorization", f"Bearer {TOKEN}"),)

    def request(function="Counter", episode="", start=False, end="", method=None, timeout_s=5.0, **args):
        samples = [] if method is None else [pb.Sample(columns_json=json.dumps({"method": method, "args": args}))]
        return pb.ScoreRequest(function=function, samples=samples, timeout_s=timeout_s, episode=episode,
                               episode_start=start, episode_end=end)

    def send(r, timeout=30):
        try:
            reply = stub.Score(r, metadata=metadata, timeout=timeout)
            return [(pb.Status.Name(s.status), s.result_json) for s in reply.scores]
        except grpc.RpcError as e:
            return e.code()

    def starts_all(function, n):
        ids = [uuid.uuid4().hex for _ in range(n)]
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(lambda e: send(request(function, e, start=True, method="reset", timeout_s=2),
                                                   timeout=8), ids))
        for e in ids:
            send(request(function, end=e))
        return answers

    live = uuid.uuid4().hex
    assert send(request(episode=live, start=True, method="reset"))[0][0] == "STATUS_OK"
    assert send(request(episode=live, start=True, method="reset")) == grpc.StatusCode.ALREADY_EXISTS  # a restart
    for timeout_s in (-1.0, 0.0, float("nan"), float("inf")):  # what the sandbox would refuse after the map changed
        assert send(request(episode=live, start=True, method="reset", timeout_s=timeout_s)) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert send(request(end=live, timeout_s=timeout_s)) == grpc.StatusCode.INVALID_ARGUMENT
    status, before = send(request(episode=live, method="bump", by=1))[0]
    assert status == "STATUS_OK" and json.loads(before[1:])["n"] == 1  # still mapped, still served
    held = uuid.uuid4().hex
    send(request("Other", held, start=True, method="reset"))
    send(request(episode=uuid.uuid4().hex, start=True, end=held, method="reset"))  # an end named for Other's id
    assert send(request("Other", held, method="bump", by=2))[0][0] == "STATUS_OK"
    # a new version while episodes live: refused, and nothing ends
    source = pb.FunctionSource(name="Counter", filename="counter2.py", source=COUNTER + "\n# v2\n",
                               function="Counter", style=pb.Style.Value("STYLE_ENVIRONMENT"))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Load(pb.LoadRequest(functions=[source]), metadata=metadata, timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "live episode" in refused.value.details()
    status, after = send(request(episode=live, method="bump", by=1))[0]
    assert status == "STATUS_OK" and json.loads(after[1:]) == {"n": 2, "pid": json.loads(before[1:])["pid"]}
    for _ in range(4):  # starts, ends and calls of one id at once
        x = uuid.uuid4().hex
        racing = [request(episode=x, start=True, method="reset"), request(end=x),
                  request(episode=x, method="bump", by=1), request(episode=x, start=True, end=x, method="reset"),
                  request(end=x)]
        with concurrent.futures.ThreadPoolExecutor(len(racing)) as pool:
            list(pool.map(send, racing))
    for deadline in (0.001, 0.003, 0.01) * 10:  # starts their own clients give up on (round 2)
        try:
            stub.Score(request(episode=uuid.uuid4().hex, start=True, method="reset"), metadata=metadata,
                       timeout=deadline)
        except grpc.RpcError:
            pass
    time.sleep(1.5)  # past --episode-idle-s: the next request's sweep ends whatever the map still names
    assert starts_all("Other", 1) == [[("STATUS_OK", 'j"from 0"')]]
    time.sleep(0.5)
    assert starts_all("Counter", 4) == [[("STATUS_OK", 'j"from 0"')]] * 4  # every slot free again
    channel.close()
