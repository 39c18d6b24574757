"""The client's splitting, deadlines, retries, recovery and fallbacks, against the fake transport: no process,
no container, no wait (the retries' sleep is recorded, not slept)."""

from __future__ import annotations

import math

import grpc
import pytest

from rewardbox import BackendError, RewardSandboxes, build_samples, parse_config
from rewardbox.scoring.replica import Replica
from rewardbox.wire import HARD_TIMEOUT_MARGIN_S, Status
from rewardbox.wire.pb import reward_pb2 as pb
from tests.conftest import no_sleep, run
from rewardbox.errors import TransportError
from tests.fakes import FakeBackend, FakeSandbox, FakeTransport, answer, length_of_completion


def start(tmp_path, reward: dict | None = None, sandbox: dict | None = None, make=FakeSandbox):
    """Started RewardSandboxes for one reward ``r`` on fake sandboxes; returns (sandboxes, its fake sandboxes)."""
    (tmp_path / "r.py").write_text("def r(prompt, completion, example):\n    return 1.0\n")
    config = parse_config({"sandbox": {"backend": "local", **(sandbox or {})},
                           "rewards": [{"name": "r", "source": "r.py", **(reward or {})}]}, tmp_path)
    transport = FakeTransport()
    backend = FakeBackend(transport, make)
    no_sleep.calls = []
    s = RewardSandboxes(config, backend=backend, transport=transport, sleep=no_sleep)
    s.start()
    return s, backend.sandboxes


def samples(n: int) -> list:
    return build_samples(["p"] * n, ["x" * (i + 1) for i in range(n)], {})


def completions(request: pb.ScoreRequest) -> list[str]:
    return [s.completion for s in request.samples]


def test_a_batch_is_split_in_order_across_replicas_and_reassembled(tmp_path):
    s, fakes = start(tmp_path, {"replicas": 3})
    report = run(s["r"].client.score(samples(10)))
    assert report.values == [float(i + 1) for i in range(10)]
    assert report.statuses == [Status.OK] * 10 and report.attempts == 1
    shares = sorted(completions(f.calls[0][0]) for f in fakes)
    assert sorted(len(share) for share in shares) == [3, 3, 4]
    assert sorted(c for share in shares for c in share) == sorted("x" * (i + 1) for i in range(10))
    for share in shares:  # each replica got a contiguous run of the batch
        lengths = [len(c) for c in share]
        assert lengths == list(range(lengths[0], lengths[0] + len(lengths)))


def test_a_batch_style_call_goes_whole_to_one_replica(tmp_path):
    s, fakes = start(tmp_path, {"replicas": 3, "style": "batch"})
    run(s["r"].client.score(samples(7)))
    assert sorted(len(f.calls) for f in fakes) == [0, 0, 1]


def test_each_attempt_gets_the_deadline_the_server_needs_plus_grace(tmp_path):
    s, [fake] = start(tmp_path, {"timeout_s": 1.5, "workers": 4}, {"rpc_grace_s": 3})
    run(s["r"].client.score(samples(9)))
    # 9 samples over 4 workers: 3 in series; a crashed chunk re-runs, so twice that, plus the grace
    assert fake.calls[0][1] == pytest.approx(2 * 3 * (1.5 + HARD_TIMEOUT_MARGIN_S) + 3)
    assert fake.calls[0][0].timeout_s == 1.5  # the per-sample timeout travels to the server


def test_a_transient_failure_is_retried_on_the_next_replica_with_only_the_unscored_samples(tmp_path):
    s, fakes = start(tmp_path, {"replicas": 2, "retries": 2}, {"backoff_initial_s": 0.5})
    fakes[1].script = [grpc.StatusCode.UNAVAILABLE]
    report = run(s["r"].client.score(samples(6)))
    assert report.statuses == [Status.OK] * 6 and report.values == [float(i + 1) for i in range(6)]
    assert report.attempts == 2
    first_share = completions(fakes[0].calls[0][0])
    failed_share = completions(fakes[1].calls[0][0])
    assert set(first_share).isdisjoint(failed_share)
    # the retry carried exactly the samples that had no score, split across both replicas
    retried = [c for f in fakes for r, _ in f.calls[1 if f is fakes[0] else 1:] for c in completions(r)]
    assert sorted(retried) == sorted(failed_share)
    assert len(fakes[0].calls) > 1 and len(fakes[1].calls) > 1
    assert len(no_sleep.calls) == 1 and 0 <= no_sleep.calls[0] <= 0.5 * 2  # backoff with jitter


# UNKNOWN: the sandbox server raised what it did not expect (a broken pipe while it wrote a request lost whole
# batches after one attempt: red team)
@pytest.mark.parametrize("code", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.UNKNOWN])
def test_every_transient_code_is_retried(tmp_path, code):
    s, [fake] = start(tmp_path, {"retries": 1})
    fake.script = [code]
    report = run(s["r"].client.score(samples(2)))
    assert report.statuses == [Status.OK] * 2 and report.attempts == 2


def test_a_sandbox_that_stays_unavailable_falls_back_after_all_retries_with_backoff(tmp_path):
    s, [fake] = start(tmp_path, {"retries": 3, "default_score": None}, {"backoff_initial_s": 0.2,
                                                                          "backoff_max_s": 0.5})
    fake.script = [grpc.StatusCode.UNAVAILABLE] * 10
    report = run(s["r"].client.score(samples(3)))
    assert report.values == [None] * 3 and report.statuses == [Status.UNAVAILABLE] * 3
    assert "after 4 attempt(s)" in report.errors[0] and "UNAVAILABLE" in report.errors[0]
    # the whole share once, then each retry one request per unscored sample (split up to 4 ways)
    assert [len(r.samples) for r, _ in fake.calls] == [3] + [1] * 9 and len(no_sleep.calls) == 3
    assert all(0 <= d <= min(0.5, 0.2 * 2 ** (i + 1)) for i, d in enumerate(no_sleep.calls))


def test_each_retry_splits_finer_so_that_several_samples_that_take_their_sandbox_down_end_up_alone(tmp_path):
    # Four such samples spread through 16 ended all 16 UNAVAILABLE: every retry sent the same four parts, each with
    # one of them (red team, one replica). Now the parts are 4, then 16: the other 12 keep their scores.
    s, [fake] = start(tmp_path, {"retries": 3, "default_score": -5.0})

    def down_with_a_bomb(request):
        if any(c.startswith("bomb") for c in completions(request)):
            raise TransportError(grpc.StatusCode.UNAVAILABLE, "this sandbox stopped")
        return answer(length_of_completion)(request)

    fake.default = down_with_a_bomb
    batch = ["bomb" if i % 4 == 0 else "x" * (i + 1) for i in range(16)]
    report = run(s["r"].client.score(build_samples(["p"] * 16, batch, {})))
    assert report.statuses == [Status.UNAVAILABLE if i % 4 == 0 else Status.OK for i in range(16)]
    assert report.values == [-5.0 if i % 4 == 0 else float(i + 1) for i in range(16)]
    assert [len(r.samples) for r, _ in fake.calls][:6] == [16, 4, 4, 4, 4, 1] and report.attempts == 4


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.UNAUTHENTICATED])
def test_a_non_transient_failure_is_not_retried_and_falls_back(tmp_path, code):
    s, [fake] = start(tmp_path, {"retries": 5, "default_score": -1.0})
    fake.script = [code]
    report = run(s["r"].client.score(samples(2)))
    assert report.values == [-1.0, -1.0] and report.statuses == [Status.UNAVAILABLE] * 2
    assert code.name in report.errors[0] and len(fake.calls) == 1 and no_sleep.calls == []


def test_a_server_that_lost_the_function_gets_it_loaded_again_and_the_batch_is_retried(tmp_path):
    s, [fake] = start(tmp_path)
    fake.loaded.clear()  # as after a server restart the host did not see
    report = run(s["r"].client.score(samples(2)))
    assert report.statuses == [Status.OK] * 2 and report.attempts == 2
    assert len(fake.loads) == 2 and fake.restarts == 0  # reloaded, not restarted: it was healthy


def test_an_unhealthy_sandbox_is_restarted_and_reloaded_before_the_retry(tmp_path):
    s, [fake] = start(tmp_path)
    fake.running = False  # it died
    report = run(s["r"].client.score(samples(2)))
    assert report.statuses == [Status.OK] * 2
    assert fake.restarts == 1 and report.restarts == 1 and len(fake.loads) == 2


def test_a_healthy_but_slow_sandbox_is_not_restarted(tmp_path):
    s, [fake] = start(tmp_path, {"retries": 1})
    fake.script = [grpc.StatusCode.DEADLINE_EXCEEDED]
    run(s["r"].client.score(samples(2)))
    assert fake.restarts == 0 and len(fake.loads) == 1


def test_every_value_from_a_sandbox_is_checked_again_on_the_host(tmp_path):
    def forged(request: pb.ScoreRequest) -> pb.ScoreResponse:
        return pb.ScoreResponse(scores=[
            pb.Score(value=math.nan, status=Status.OK.wire),
            pb.Score(value=math.inf, status=Status.OK.wire),
            pb.Score(value=1.0, status=Status.UNAVAILABLE.wire),  # a status only the host may set
            pb.Score(value=1.0, status=42),  # not a status at all
            pb.Score(value=5.0, status=Status.ERROR.wire, error="boom"),  # a value with a failure is dropped
            pb.Score(status=Status.OK.wire),  # None
            pb.Score(value=0.5, status=Status.OK.wire),
        ])

    s, [fake] = start(tmp_path, {"default_score": -1.0})
    fake.default = forged
    report = run(s["r"].client.score(samples(7)))
    assert report.statuses == [Status.INVALID, Status.INVALID, Status.INVALID, Status.ERROR, Status.ERROR,
                               Status.OK, Status.OK]
    assert report.values == [-1.0, -1.0, -1.0, -1.0, -1.0, None, 0.5]


def test_a_reply_with_the_wrong_number_of_scores_falls_back_for_the_whole_share(tmp_path):
    s, [fake] = start(tmp_path, {"default_score": 0.0})
    fake.default = lambda request: pb.ScoreResponse(scores=[pb.Score(value=1.0, status=Status.OK.wire)])
    report = run(s["r"].client.score(samples(3)))
    assert report.statuses == [Status.UNAVAILABLE] * 3
    assert "returned 1 scores for 3 samples" in report.errors[0]


def test_the_trainer_state_travels_with_every_request(tmp_path):
    s, [fake] = start(tmp_path)
    run(s["r"](["p"], ["x"], trainer_state={"global_step": 7, "max_steps": 10, "epoch": 0.5}))
    request = fake.calls[0][0]
    assert request.has_trainer_state and request.trainer_state.global_step == 7
    assert request.trainer_state.epoch == 0.5


def test_a_sandbox_that_never_becomes_healthy_fails_the_start_with_its_logs_and_is_stopped(tmp_path):
    with pytest.raises(BackendError, match=r"(?s)did not become healthy within 0\.3s.*fake server log"):
        start(tmp_path, sandbox={"start_timeout_s": 0.3}, make=lambda name: FakeSandbox(name, healthy=False))


def test_a_start_failure_stops_what_started_but_not_a_backend_it_was_handed(tmp_path):
    transport = FakeTransport()
    backend = FakeBackend(transport, lambda name: FakeSandbox(name, healthy=not name.startswith("b")))
    (tmp_path / "r.py").write_text("def r(prompt, completion, example):\n    return 1.0\n")
    config = parse_config({"sandbox": {"backend": "local", "start_timeout_s": 0.3},
                           "rewards": [{"name": "a", "source": "r.py", "function": "r", "replicas": 2},
                                       {"name": "b", "source": "r.py", "function": "r"}]}, tmp_path)
    with pytest.raises(BackendError):
        RewardSandboxes(config, backend=backend, transport=transport).start()
    assert [s.stopped for s in backend.sandboxes] == [True, True, True]
    assert not backend.closed  # whoever made it closes it
    assert all(c.closed for c in transport.connections)


def test_a_replica_reconnects_after_a_restart(tmp_path):
    fake = FakeSandbox("solo")
    transport = FakeTransport(fake)
    replica = Replica(fake, [], start_timeout_s=1, transport=transport)
    replica.start()
    first = replica.connection
    fake.running = False
    replica.recover(replica.generation)
    assert replica.connection is not first and first.closed and fake.restarts == 1


def test_a_sample_that_takes_its_sandbox_down_every_time_is_isolated_and_the_others_keep_their_scores(tmp_path):
    def breaks_on_poison(request: pb.ScoreRequest) -> pb.ScoreResponse:
        if any(s.completion == "poison" for s in request.samples):
            raise TransportError(grpc.StatusCode.UNAVAILABLE, "the server died")
        return answer(lambda sample: float(len(sample.completion)))(request)

    s, fakes = start(tmp_path, {"replicas": 2, "retries": 3, "default_score": -1.0})
    for fake in fakes:
        fake.default = breaks_on_poison
    completions_ = ["x" * (i + 1) for i in range(64)]
    completions_[37] = "poison"
    report = run(s["r"].client.score(build_samples(["p"] * 64, completions_, {})))
    assert report.statuses[37] == Status.UNAVAILABLE and report.values[37] == -1.0
    innocent = [i for i in range(64) if i != 37]
    assert [report.statuses[i] for i in innocent] == [Status.OK] * 63
    assert [report.values[i] for i in innocent] == [float(i + 1) for i in innocent]
    assert report.attempts == 4
    # no batch-style call is ever split: a TRL reward may compare the completions of its batch
    (tmp_path / "batch").mkdir()
    s2, [fake] = start(tmp_path / "batch", {"style": "batch", "retries": 2})
    fake.script = [grpc.StatusCode.UNAVAILABLE] * 2
    run(s2["r"].client.score(samples(8)))
    assert [len(r.samples) for r, _ in fake.calls] == [8, 8, 8]


def test_no_call_carries_more_than_its_share_of_the_sandbox_memory(tmp_path):
    s, fakes = start(tmp_path, {"memory": "32m"})  # 1 MiB a call (1/32)
    big = "x" * (300 << 10)
    report = run(s["r"].client.score(build_samples(["p"] * 8, [big] * 7 + ["x" * (2 << 20)], {})))
    assert report.values[:7] == [float(len(big))] * 7 and report.attempts == 1
    sizes = [len(completions(request)) for request, *_ in fakes[0].calls]
    assert sizes == [3, 3, 1]  # in order, none over 1 MiB
    assert report.statuses[7] == Status.ERROR and report.values[7] == 0.0
    assert report.errors[7] == ("this sample is 2.0 MiB, more than one call to reward 'r' may carry (1.0 MiB, 1/32 "
                                "of its `memory: 32m`: its sandbox holds a call several times over); raise `memory:` "
                                "of the reward")


def test_a_batch_style_call_over_its_share_of_the_sandbox_memory_gets_the_error_for_every_sample(tmp_path):
    s, fakes = start(tmp_path, {"memory": "32m", "style": "batch"})
    report = run(s["r"].client.score(build_samples(["p"] * 4, ["x" * (300 << 10)] * 4, {})))
    assert report.statuses == [Status.ERROR] * 4 and not fakes[0].calls
    assert report.errors[0].startswith("the batch's samples are 1.2 MiB, more than one call")


class FullService(FakeSandbox):
    """A shared service whose max_in_flight budget is full: it defers whole calls (RESOURCE_EXHAUSTED)."""

    shared = True
    max_wait_s = 2.0


def test_a_full_budget_is_waited_for_with_backoff_and_uses_up_no_retry(tmp_path):
    s, [fake] = start(tmp_path, {"retries": 1}, {"backoff_initial_s": 0.1, "backoff_max_s": 0.4},
                      make=FullService)
    fake.script = [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
    report = run(s["r"].client.score(samples(3)))
    assert report.statuses == [Status.OK] * 3 and report.attempts == 1 and len(fake.calls) == 4
    assert len(no_sleep.calls) == 3 and all(0 <= d <= min(0.4, 0.1 * 2 ** (i + 1))
                                            for i, d in enumerate(no_sleep.calls))


def test_samples_a_budget_kept_full_past_max_wait_s_end_unavailable_naming_it(tmp_path):
    s, [fake] = start(tmp_path, {"retries": 2, "default_score": -1.0}, {"backoff_initial_s": 0.2,
                                                                          "backoff_max_s": 0.5}, make=FullService)
    fake.default = lambda request: (_ for _ in ()).throw(TransportError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"))
    report = run(s["r"].client.score(samples(2)))
    assert report.values == [-1.0, -1.0] and report.statuses == [Status.UNAVAILABLE] * 2
    assert "max_in_flight stayed full for 2s" in report.errors[0] and report.attempts == 1
    waited = sum(no_sleep.calls)
    assert FullService.max_wait_s <= waited < FullService.max_wait_s + 0.5
    assert len(fake.calls) == len(no_sleep.calls) + 1  # a call after each wait
