"""Shard leases: how a dead worker is told from a slow one (docs/operations.md, "Faults").

A worker running a shard holds a lease on it in Redis (`batchspec:job:ID:lease:SHARD`, its
token with a TTL) and renews it from a background thread, independent of engine steps, so
a slow step never makes a live shard look dead. A `running` shard whose lease is gone lost
its worker (kill -9, OOM kill, lost host): whoever notices first (every worker's periodic
check, `batchspec status`, `submit --wait`, beat) puts it back to queued, once, and sends
its task again.

Settings (environment, seconds):
  BATCHSPEC_LEASE_TTL       how long a lease lives without renewal [30]
  BATCHSPEC_LEASE_RENEW     how often its worker renews it [5]
  BATCHSPEC_CHECK_INTERVAL  how often each worker (and beat) checks the active jobs [10]
  BATCHSPEC_STEP_TIMEOUT    how long one engine step may run before the worker process
                            running it is taken as stuck and exits [600]
A dead worker's shard is re-queued within TTL + CHECK_INTERVAL of its last renewal.

A lease proves that its process lives, not that it gets anywhere: a step stuck for good (a
collective waiting on a stopped tensor-parallel rank, a hung device) would hold its shard,
and the job, forever. So the thread that renews a lease also watches the process's engine
step (STEPS), and one stuck past the step timeout exits the process: a prefork worker's
parent starts another, which runs the shard again (a new attempt); a solo worker is gone
and the shard is re-queued when its lease expires."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager

log = logging.getLogger(__name__)


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{name}={value!r} must be positive")
    return seconds


def lease_ttl() -> float:
    return _seconds("BATCHSPEC_LEASE_TTL", 30.0)


def lease_renew() -> float:
    """Renewal interval; at most a third of the TTL, so two missed renewals are survived."""
    return min(_seconds("BATCHSPEC_LEASE_RENEW", 5.0), lease_ttl() / 3)


def check_interval() -> float:
    return _seconds("BATCHSPEC_CHECK_INTERVAL", 10.0)


def step_timeout() -> float:
    return _seconds("BATCHSPEC_STEP_TIMEOUT", 600.0)


# Exit status of a worker process whose engine step was stuck past the step timeout.
STUCK_EXIT = 70


class StepClock:
    """When the engine step now running in this process began (None between steps), for
    the leases' watchdog."""

    def __init__(self):
        self.since: float | None = None

    @contextmanager
    def step(self):
        self.since = time.monotonic()
        try:
            yield
        finally:
            self.since = None

    def running_for(self) -> float:
        since = self.since
        return 0.0 if since is None else time.monotonic() - since


STEPS = StepClock()


def _machine() -> str:
    """This machine's name: hostname and boot id, so that pids are compared only between
    processes of the same machine and boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = ""
    return f"{socket.gethostname()}~{boot}"


def new_token() -> str:
    """A lease token: machine, pid, and a random part unique to this run of the shard."""
    return f"{_machine()}/{os.getpid()}/{uuid.uuid4().hex[:12]}"


def holder_is_dead(token: str | None) -> bool:
    """True when the token's process is known to be gone: it ran on this machine and its
    pid no longer exists (a pool child killed mid-shard), or it is this very process (a
    previous run of the shard here that ended without recording it). A holder on another
    machine is alive until its lease expires."""
    if not token:
        return False
    machine, _, rest = token.rpartition("/")[0].rpartition("/")
    if machine != _machine():
        return False
    pid = int(rest)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


class Lease:
    """Renews a shard's lease every `renew` seconds from a daemon thread until stopped.
    Renewals that cannot reach Redis are retried at the next tick (the TTL covers a Redis
    restart of several seconds); a renewal refused because the lease is no longer this
    worker's (it expired and the shard was re-queued) stops the thread and sets `lost`.
    taken_at: time.monotonic() before the lease was taken (default: now)."""

    def __init__(self, store, job_id: str, shard_id: str, token: str, ttl: float,
                 renew: float, taken_at: float | None = None):
        self.store, self.job_id, self.shard_id, self.token = store, job_id, shard_id, token
        self.ttl, self.renew = ttl, renew
        self.lost = False
        # until when (time.monotonic()) the lease surely holds: TTL after the request of the
        # last renewal Redis granted (Redis counts the TTL from when it got the request)
        self._holds_until = (time.monotonic() if taken_at is None else taken_at) + ttl
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"lease-{job_id}-{shard_id}")

    def start(self) -> Lease:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.renew + 5)

    def __enter__(self) -> Lease:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def held(self) -> bool:
        """Whether the lease is still this worker's, asked of Redis now (a renewal); sets
        `lost` when it is not. A shard's files are written only after asking: a worker
        frozen past its lease (a paused VM) and woken before its next renewal would
        otherwise write over the files of the worker that ran the shard since.

        While Redis cannot be reached, the lease holds until TTL after the last renewal it
        granted: within that, True (the files are written, and the shard's end is recorded
        later from them, see reconcile). Past it the lease has expired in Redis, and a
        worker that reaches Redis may have the shard now: this waits until Redis answers,
        then says what it says. A worker cut off from Redis alone (its host's network)
        used to write the shard's files after another worker had taken the shard over,
        before or after that worker wrote its own (tests/test_faults.py)."""
        waiting_since = None
        while not self.lost:
            asked = time.monotonic()
            try:
                if self.store.renew_lease(self.job_id, self.shard_id, self.token, self.ttl):
                    self._holds_until = asked + self.ttl
                    return True
                self.lost = True
            except Exception as e:  # noqa: BLE001 - Redis unreachable
                if time.monotonic() < self._holds_until:
                    log.warning("could not ask for the lease on shard %s of job %s (%s); it "
                                "holds for %.0f s more: writing the shard's files",
                                self.shard_id, self.job_id, e,
                                self._holds_until - time.monotonic())
                    return True
                if waiting_since is None or time.monotonic() - waiting_since >= 60:
                    log.warning("could not ask for the lease on shard %s of job %s (%s), "
                                "which has expired by now: its files wait until Redis "
                                "answers (another worker may have the shard)",
                                self.shard_id, self.job_id, e)
                    waiting_since = time.monotonic()
                time.sleep(self.renew)
        return False

    def _run(self) -> None:
        timeout = step_timeout()
        while not self._stop.wait(self.renew):
            stuck = STEPS.running_for()
            if stuck > timeout:
                log.error("an engine step has run for %.0f s (BATCHSPEC_STEP_TIMEOUT=%.0f): "
                          "this process is stuck; it exits so that shard %s of job %s and "
                          "the others run again", stuck, timeout, self.shard_id, self.job_id)
                logging.shutdown()
                os._exit(STUCK_EXIT)
            asked = time.monotonic()
            try:
                if self.store.renew_lease(self.job_id, self.shard_id, self.token, self.ttl):
                    self._holds_until = asked + self.ttl
                else:
                    if not self._stop.is_set():
                        log.info("lease on shard %s of job %s no longer held (the shard "
                                 "ended, or was re-queued)", self.shard_id, self.job_id)
                        self.lost = True
                    return
            except Exception as e:  # Redis down: try again at the next tick
                log.warning("could not renew the lease on shard %s of job %s: %s",
                            self.shard_id, self.job_id, e)
