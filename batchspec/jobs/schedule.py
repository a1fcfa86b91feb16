"""Nightly jobs: job YAML files with a `schedule` become Celery beat entries. Each firing
sends `batchspec.submit_scheduled(path)`; a worker reads the YAML then, so the dates in its
paths ({date}, {yesterday}, {now:%H%M}) are those of the firing, and edits to a YAML apply
from its next firing.

`schedule` is a five-field cron line in UTC ("30 2 * * *") or an interval ("every 10m",
"every 30s", for tests and frequent refreshes)."""
from __future__ import annotations

import datetime as dt
import glob
import os
import re

import yaml
from celery.schedules import crontab

from batchspec.jobs.spec import JobSpec

_EVERY = re.compile(r"^every\s+(\d+)\s*([smhd])$")
# A firing that cannot reach Redis is sent again until it can (every 1 s, then up to every
# 30 s): beat moves a schedule to its next run before sending, so a firing that failed was
# lost, and a Redis restart at 2:30 meant no job that night.
FIRING_RETRY = {"max_retries": None, "interval_start": 1, "interval_step": 2,
                "interval_max": 30}
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_schedule(text: str):
    """A cron line or 'every N{s,m,h,d}' -> a Celery schedule."""
    text = str(text).strip()
    m = _EVERY.match(text)
    if m:
        n = int(m.group(1))
        if n < 1:
            raise ValueError(f"schedule {text!r}: the interval must be positive")
        return dt.timedelta(**{_UNITS[m.group(2)]: n})
    fields = text.split()
    if len(fields) != 5:
        raise ValueError(f"schedule {text!r} is neither a 5-field cron line "
                         f"('minute hour day month weekday') nor 'every N[s|m|h|d]'")
    minute, hour, day, month, weekday = fields
    try:
        return crontab(minute=minute, hour=hour, day_of_month=day, month_of_year=month,
                       day_of_week=weekday)
    except ValueError as e:
        raise ValueError(f"schedule {text!r}: {e}") from e


def load_schedules(jobs_dir: str) -> dict:
    """{entry name: beat entry} for every *.yaml / *.yml in jobs_dir with a `schedule`.
    Every file is validated now (dates filled with today) so a broken job definition stops
    beat at start instead of failing at 2 am."""
    paths = sorted(glob.glob(os.path.join(jobs_dir, "*.yaml"))
                   + glob.glob(os.path.join(jobs_dir, "*.yml")))
    if not os.path.isdir(jobs_dir):
        raise ValueError(f"jobs directory {jobs_dir!r} does not exist")
    entries = {}
    for path in paths:
        try:
            with open(path) as f:
                doc = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{path} is not valid YAML: {e}") from e
        if not isinstance(doc, dict) or "schedule" not in doc:
            continue
        try:
            schedule = parse_schedule(doc["schedule"])
            spec = JobSpec.build(config=path)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"{path}: {e}") from e
        name = spec.name or os.path.splitext(os.path.basename(path))[0]
        # a firing is built in a worker, whose directory may be another: the YAML's
        # relative paths resolve against beat's, where they were checked now
        entries[name] = {"task": "batchspec.submit_scheduled", "schedule": schedule,
                         "args": (os.path.abspath(path), os.getcwd()),
                         "options": {"retry": True, "retry_policy": FIRING_RETRY}}
    if not entries:
        raise ValueError(f"no job YAML with a `schedule` in {jobs_dir!r}")
    return entries
