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
    worker's (it expired and the shard was re-queued) stops the thread and sets `lost`."""

    def __init__(self, store, job_id: str, shard_id: str, token: str, ttl: float,
                 renew: float):
        self.store, self.job_id, self.shard_id, self.token = store, job_id, shard_id, token
        self.ttl, self.renew = ttl, renew
        self.lost = False
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
        otherwise write over the files of the worker that ran the shard since. A store that
        cannot be reached answers True (the files are written, as before the lease could
        be asked; the shard's end is recorded later, see reconcile)."""
        if self.lost:
            return False
        try:
            if self.store.renew_lease(self.job_id, self.shard_id, self.token, self.ttl):
                return True
        except Exception as e:  # noqa: BLE001 - Redis down: as if held
            log.warning("could not ask for the lease on shard %s of job %s: %s",
                        self.shard_id, self.job_id, e)
            return True
        self.lost = True
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
            try:
                if not self.store.renew_lease(self.job_id, self.shard_id, self.token,
                                              self.ttl):
                    if not self._stop.is_set():
                        log.info("lease on shard %s of job %s no longer held (the shard "
                                 "ended, or was re-queued)", self.shard_id, self.job_id)
                        self.lost = True
                    return
            except Exception as e:  # Redis down: try again at the next tick
                log.warning("could not renew the lease on shard %s of job %s: %s",
                            self.shard_id, self.job_id, e)
