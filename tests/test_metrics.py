"""Prometheus metrics: a live `batchspec worker --metrics-port` (prefork pool, multiprocess
mode) scraped while a job runs, and `batchspec run --metrics-port`."""
from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchspec.jobs.store import JobStore
from tests.fixtures_redis import free_port, wait_until
from tests.test_jobs_celery import batchspec, wait_job


def scrape(port: int) -> dict[tuple[str, tuple], float] | None:
    """{(sample name, sorted labels): value} of the endpoint; None while it is not up."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == v2 for k, v2 in labels.items()))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("metrics") / "p.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(16)],
                             "prompt": [f"def f{i}(x):\n    return x +" for i in range(16)],
                             "domain": ["code" if i % 2 else None for i in range(16)]}), path)
    return path


@pytest.mark.slow
def test_worker_metrics_scraped_mid_job(start_worker, redis_server, model_factory, tiny_draft,
                                        prompts, tmp_path):
    # A model slow enough that 8 shards take seconds, so the job is seen running.
    model = model_factory("llama", hidden_size=384, num_layers=8, num_heads=6,
                          num_kv_heads=6, seed=2)
    port = free_port()
    worker = start_worker("metrics", BATCHSPEC_METRICS_PORT=str(port))
    r = batchspec(redis_server, "submit", prompts, "-o", tmp_path / "out", "--model", model,
                  "--draft", f"default={tiny_draft}", "--draft", "code=ngram",
                  "--shard-size", "2", "--max-tokens", "24",
                  "--fixed-k")   # drafts every round (adaptive lengths may decode plainly)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().splitlines()[-1]
    store = JobStore(redis_server)

    def mid_job():
        samples = scrape(port)
        running = store.get(job_id)["state"] == "running"
        if samples and running and total(samples, "batchspec_spec_drafted_tokens_total") > 0:
            return samples
        assert store.get(job_id)["state"] in ("queued", "running"), "job ended unobserved"
        return None

    samples = wait_until(mid_job, 240, "drafted tokens in /metrics while the job runs", 0.3)
    assert total(samples, "batchspec_spec_accepted_tokens_total") > 0
    assert total(samples, "batchspec_rows_total", job=job_id, state="completed") > 0
    assert total(samples, "batchspec_engine_step_seconds_count") > 0
    assert ("batchspec_queue_depth", ()) in samples
    wait_job(store, job_id)
    samples = wait_until(lambda: (s := scrape(port)) and total(
        s, "batchspec_rows_total", job=job_id) == 16 and s, 30, "every row counted")
    assert total(samples, "batchspec_shards_total", job=job_id) == 8
    assert total(samples, "batchspec_spec_requests_total") == 16
    drafts = {dict(ls).get("draft") for (n, ls) in samples if n == "batchspec_spec_requests_total"}
    assert "ngram" in drafts and os.path.basename(tiny_draft) in drafts
    assert total(samples, "batchspec_generated_tokens_total", job=job_id) == \
        store.get(job_id)["tokens_generated"]
    assert total(samples, "batchspec_shard_duration_seconds_count") == 8
    assert worker.proc.poll() is None


def test_run_serves_metrics(tiny_llama, tiny_draft, prompts, tmp_path):
    """`batchspec run --metrics-port` in a subprocess: the endpoint answers while it runs
    (the run is held at its end by a scrape loop in this test: the port is polled until
    the counters show the whole job, then the process is let go)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from batchspec.cli import main\n"
         "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
         "sys.stdout.write('ended\\n'); sys.stdout.flush(); time.sleep(60)\n",
         "run", str(prompts), "-o", str(tmp_path / "out"), "-q", "--model", tiny_llama,
         "--draft", f"default={tiny_draft}", "--max-tokens", "6", "--metrics-port", str(port),
         "--fixed-k"],   # drafts every round (adaptive lengths may decode plainly)
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        samples = wait_until(lambda: (s := scrape(port)) and total(
            s, "batchspec_rows_total", state="completed") == 16 and s, 240, "16 rows counted")
        assert total(samples, "batchspec_spec_drafted_tokens_total") > 0
        assert total(samples, "batchspec_kv_cache_usage_ratio") >= 0
    finally:
        proc.kill()
        proc.wait(30)


def test_metrics_port_in_use_is_one_line(tiny_llama, prompts, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "batchspec.cli", "run", str(prompts), "-o",
                            str(tmp_path / "out"), "--model", tiny_llama,
                            "--metrics-port", str(port)], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"cannot serve metrics on port {port}" in r.stderr
