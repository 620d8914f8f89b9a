"""The service's worker pool: workers start in the background, and a job waits for a started one."""

from __future__ import annotations

import threading

import pytest

from autotune.serve.jobs import Job, JobFailed
from autotune.serve.worker import Pool, Worker


@pytest.fixture
def slow_starts(monkeypatch):
    """Workers whose start waits for ``release`` and whose jobs answer at once, naming the worker."""
    release = threading.Event()
    started: list[int] = []

    def start(self: Worker) -> None:
        assert release.wait(30)
        started.append(self.index)

    def run(self: Worker, job: dict, timeout_s: float, stop=None) -> dict:
        assert self.index in started, "a job ran on a worker that was not started"
        return {"ok": True, "worker": self.index, "job": job["n"]}

    monkeypatch.setattr(Worker, "start", start)
    monkeypatch.setattr(Worker, "run", run)
    monkeypatch.setattr(Worker, "stop", lambda self: None)
    return release, started


def test_the_pool_answers_at_once_and_jobs_wait_for_a_started_worker(slow_starts):
    release, started = slow_starts
    pool = Pool("sqlite://", 2, timeout_s=60)
    pool.start()  # returns while no worker has started
    assert started == [] and pool.busy == 0
    answers: list[dict] = []
    job = threading.Thread(target=lambda: answers.append(pool.run(Job({"n": 1}, frozenset({"key"})))))
    job.start()
    job.join(0.2)
    assert job.is_alive() and answers == []  # waits: no worker has started
    release.set()
    job.join(30)
    assert answers and answers[0]["job"] == 1 and answers[0]["worker"] in (0, 1)
    assert pool.run(Job({"n": 2}, frozenset({"key"})))["job"] == 2
    pool.stop()  # after the background start has finished
    assert sorted(started) == [0, 1] and pool.busy == 0


def test_a_worker_that_cannot_start_still_joins_the_pool(monkeypatch):
    def start(self: Worker) -> None:
        raise OSError("no processes left")

    monkeypatch.setattr(Worker, "start", start)
    monkeypatch.setattr(Worker, "stop", lambda self: None)
    monkeypatch.setattr(Worker, "run", lambda self, job, timeout_s, stop=None: {"ok": True, "worker": self.index})
    pool = Pool("sqlite://", 1, timeout_s=60)
    pool.start()
    answers: list[dict] = []
    job = threading.Thread(target=lambda: answers.append(pool.run(Job({}, frozenset({"key"})))), daemon=True)
    job.start()
    job.join(30)
    assert [a["worker"] for a in answers] == [0]  # not stuck: the job reaches the worker, whose run starts it
    pool.stop()


def test_a_job_whose_client_went_runs_on_while_a_live_job_needs_one_of_its_probes():
    """A job whose ranks differ probes each device: its key holds one item per probe, and a job for any one of
    them (not only rank 0's) keeps it running once its own client has gone."""
    pool = Pool("sqlite://", 1, timeout_s=60)
    mixed = Job({}, frozenset({("mlp", "estimate:A100-80GB"), ("mlp", "estimate:T4-16GB")}))
    t4 = Job({}, frozenset({("mlp", "estimate:T4-16GB")}))
    other = Job({}, frozenset({("mlp", "estimate:H100-80GB")}))
    pool._live.extend([mixed, t4, other])
    mixed.gone.set()
    assert pool._why_stop(mixed) is None  # the T4 job waits for the mixed job's T4 probe
    t4.gone.set()
    stopped = pool._why_stop(mixed)
    assert stopped is not None and "every client that asked for this probe hung up" in stopped.message


@pytest.mark.slow
def test_a_job_that_waits_past_its_limit_for_another_s_claim_says_whose(store_url):
    """A job whose probe another process holds (here: a claim of process 4242 on another host) is answered 504
    naming that process, not that this service stopped a probe."""
    from autotune.serve.bodies import PlanRequest
    from autotune.store import open_store
    from autotune.store.claims import MAX_LEASE_S

    from .server import PLAN

    body = PlanRequest.model_validate(PLAN).asked().to_dict()
    job = {"kind": "plan", "spec": "mlp:build", "probe": "mlp", "request": body}
    pool = Pool(store_url, 1, timeout_s=60)  # time for the first job, a probe on a new worker
    pool.start()
    try:
        fingerprint = pool.run(Job(job, frozenset({"mlp"})))["fingerprint"]
        store = open_store(store_url)
        store.remove([fingerprint])
        assert store.take(fingerprint, "elsewhere:4242:7", lease_s=MAX_LEASE_S) is None
        pool.timeout_s = 2  # the limit the second job waits out (its worker has fingerprinted this probe once)
        with pytest.raises(JobFailed) as failed:
            pool.run(Job(job, frozenset({"mlp"})))
    finally:
        pool.stop()
    assert failed.value.status == 504
    assert failed.value.message.startswith("probe 'mlp' reached the 2 s limit (--probe-timeout) waiting for process "
                                           "4242 on elsewhere, which holds the store's claim"), failed.value.message
