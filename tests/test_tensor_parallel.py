"""Tensor parallelism of the target on CPU (gloo): TP=2 gives the greedy tokens of TP=1 on
every architecture (GQA with 2 and 1 KV heads, tied embeddings, a vocabulary the ranks split
unevenly), speculative decoding with TP=2 gives those of plain TP=2, `batchspec run` and a
Celery worker owning two devices give the outputs of TP=1, and the rank processes end with
the engine: on close, on garbage collection, at the end of a run, and when rank 0's process
(or its whole process group, or a worker's pool child) is killed with SIGKILL. A rank that
dies is reported by name and closes the engine.

The random models use a wide init (std 0.1), as tests/test_models.py does, so that greedy
choices are well separated: TP sums a row-parallel product in another order than one matmul,
which moves fp32 logits by about 1e-6, and only a near-tie could turn that into another
token."""
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from batchspec import LLM, SamplingParams
from batchspec.config import EngineConfig
from batchspec.jobs.spec import JobSpec
from tests.fixtures_redis import wait_until
from tests.jobdata import make_inputs, read_dir

PROMPTS = [[5, 17, 300, 42], [7], list(range(60, 100)), [11, 400, 11, 400, 11, 400, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
CASES = {   # name -> make_random_model arguments
    "llama": dict(arch="llama"),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2"),
    "qwen3-tied": dict(arch="qwen3", tie_word_embeddings=True),
    # one KV head, replicated on both ranks; 509 tokens: the ranks hold 255 and 254 rows
    "llama-kv1-vocab509": dict(arch="llama", num_kv_heads=1, vocab_size=509, tokenizer=False),
    "qwen2-kv1": dict(arch="qwen2", num_kv_heads=1, tokenizer=False),
    # one KV head per query head; o_proj has a bias, added once after the all-reduce
    "llama-mha-bias": dict(arch="llama", num_kv_heads=4, attention_bias=True, tokenizer=False),
}


def make(model_factory, case: str) -> str:
    kwargs = dict(CASES[case])
    arch = kwargs.pop("arch")
    if kwargs.get("tokenizer", True):  # the models of tests/test_models.py
        return model_factory(arch, seed=3, init_std=0.1,
                             tie_word_embeddings=kwargs.get("tie_word_embeddings", False))
    path = model_factory(arch, seed=3, init_std=0.1, **kwargs)
    if kwargs.get("attention_bias"):
        randomize_biases(path)
    return path


def randomize_biases(path: str) -> None:
    """transformers initialises biases to zero; a bias counted twice would go unseen."""
    from safetensors.torch import load_file, save_file
    f = os.path.join(path, "model.safetensors")
    weights = load_file(f)
    g = torch.Generator().manual_seed(0)
    for name, t in weights.items():
        if name.endswith(".bias") and not t.any():
            weights[name] = 0.1 * torch.randn(t.shape, generator=g)
    save_file(weights, f, metadata={"format": "pt"})


def rank_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def rank_processes(model: str) -> list[int]:
    """Live rank processes (ranks 1..N-1) serving `model`, found by their command line."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if "batchspec.engine.distributed" in cmd and model in cmd and rank_alive(int(pid)):
            pids.append(int(pid))
    return pids


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if rank_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_greedy_equals_tp1(model_factory, case):
    path = make(model_factory, case)
    ref = LLM(path, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(path, device="cpu", tensor_parallel_size=2)
    assert llm.engine.target.model.num_heads == 2           # each rank holds half the heads
    assert llm.config.device == "cpu,cpu"
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    pids = llm.engine.target.rank_pids
    for r, o in zip(ref, outs):
        assert o.token_ids == r.token_ids and len(o.token_ids) == GREEDY.max_tokens
    del llm
    gc.collect()
    assert wait_gone(pids) == []


def test_biased_llama_matches_transformers(model_factory):
    """Llama with attention_bias has an o_proj bias too (once, whatever the ranks)."""
    from transformers import AutoModelForCausalLM
    path = make(model_factory, "llama-mha-bias")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    ref = hf.generate(ids, do_sample=False, max_new_tokens=24, min_new_tokens=24,
                      pad_token_id=0)[0, ids.shape[1]:].tolist()
    out = LLM(path, device="cpu", tensor_parallel_size=2).generate(PROMPTS[:1], GREEDY,
                                                                  use_tqdm=False)
    assert out[0].token_ids == ref


def test_tp2_logits_close_to_tp1(model_factory):
    """What the greedy checks rest on: the sharded forward computes the same logits."""
    path = make(model_factory, "llama-kv1-vocab509")
    one = LLM(path, device="cpu", num_kv_blocks=8, block_size=16).engine.target
    two = LLM(path, device="cpu", tensor_parallel_size=2, num_kv_blocks=8,
              block_size=16).engine.target
    rows = [list(range(3, 40)), [9, 8, 7]]
    args = (rows, [0, 0], [[0, 1, 2], [3]], [37, 3])
    a, b = one.forward(*args), two.forward(*args)
    assert b.shape == a.shape == (40, 509)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    two.close()


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_speculative_tp2_equals_plain_tp2(model_factory, tiny_llama, tiny_draft, draft):
    plain = LLM(tiny_llama, device="cpu", tensor_parallel_size=2)
    spec = LLM(tiny_llama, drafts={"default": tiny_draft if draft == "model" else "ngram"},
               num_speculative_tokens=4, min_acceptance=0.0, device="cpu",
               tensor_parallel_size=2)
    prompts = PROMPTS + ["def foo(x):\n    return x", "import os\nimport sys\nimport os"]
    ref = plain.generate(prompts, GREEDY, use_tqdm=False)
    outs = spec.generate(prompts, GREEDY, use_tqdm=False)
    for r, o in zip(ref, outs):
        assert o.token_ids == r.token_ids
    assert sum(o.stats["total_drafted"] for o in outs) > 0
    assert sum(o.stats["total_accepted"] for o in outs) > 0 or draft == "model"


def test_cancel_then_generate_again_then_close(tiny_llama):
    """A generate aborted between steps leaves the ranks in step with rank 0; close() ends
    them, and a closed target refuses to run."""
    llm = LLM(tiny_llama, device="cpu", tensor_parallel_size=2)
    steps = []
    aborted = llm.generate(PROMPTS, GREEDY, use_tqdm=False,
                           should_abort=lambda: steps.append(1) or len(steps) > 3)
    assert {o.finish_reason for o in aborted} == {"abort"}
    ref = LLM(tiny_llama, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    pids = llm.engine.target.rank_pids
    assert all(rank_alive(p) for p in pids)
    llm.engine.close()
    assert wait_gone(pids, timeout=0.5) == []   # close() waits for them
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_a_rank_that_dies_is_reported_and_closes_the_engine(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", tensor_parallel_size=2)
    [pid] = llm.engine.target.rank_pids
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 stopped during forward"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.closed


def test_devices_and_sizes(tiny_llama, model_factory):
    c = EngineConfig(tiny_llama, device="cpu,cpu")
    assert c.tensor_parallel_size == 2 and c.devices == ["cpu", "cpu"]
    assert EngineConfig(tiny_llama, device="cpu").devices == ["cpu"]
    with pytest.raises(ValueError, match="one device per rank"):
        EngineConfig(tiny_llama, device="cpu,cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        EngineConfig(tiny_llama, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        # checked when a job is submitted
        JobSpec(inputs=["x.parquet"], output="out", model=tiny_llama, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        JobSpec(inputs=["x.parquet"], output="out", model=tiny_llama, device="cuda:0,cuda:1,"
                "cuda:2")
    spec = JobSpec(inputs=["x.parquet"], output="out", model=tiny_llama, tensor_parallel_size=2)
    assert spec.engine_config(device="cpu").devices == ["cpu", "cpu"]
    assert spec.engine_config(device="cpu,cpu,cpu,cpu").tensor_parallel_size == 4  # a worker's
    with pytest.raises(ValueError, match="must divide one another"):
        EngineConfig(model_factory("llama", seed=3, hidden_size=48, num_heads=6, num_kv_heads=3,
                                   tokenizer=False), device="cpu", tensor_parallel_size=2)


KILLED_ENGINE = textwrap.dedent("""
    import sys
    from batchspec import LLM, SamplingParams
    llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
    print(" ".join(map(str, llm.engine.target.rank_pids)), flush=True)
    while True:   # the ranks are busy with forwards when the kill comes
        llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=50, ignore_eos=True),
                     use_tqdm=False)
""")


@pytest.mark.parametrize("kill", ["process-group", "rank-0-only"])
def test_no_orphaned_ranks_after_kill_9(tiny_llama, kill):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_ENGINE, tiny_llama],
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 and rank_alive(pids[0])
        time.sleep(1.0)
        assert proc.poll() is None and rank_alive(pids[0])
        if kill == "process-group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # rank 0 dies alone: the ranks notice and exit by themselves
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_gone(pids, timeout=10) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchspec.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def outputs(out) -> dict[str, list[int]]:
    t = read_dir(out, "outputs")
    return dict(zip(t.column("id").to_pylist(), t.column("token_ids").to_pylist()))


@pytest.fixture(scope="module")
def tp_job(tmp_path_factory, model_factory):
    """`batchspec run` with TP=1 and with --tensor-parallel-size 2 on the same inputs."""
    model = make(model_factory, "llama")   # a tokenizer: the inputs are text
    folder = tmp_path_factory.mktemp("tp_job")
    inputs = make_inputs(folder / "in")
    args = [*inputs, "--model", model, "--max-tokens", 12, "--shard-size", 4, "-q"]
    one = cli("run", *args, "-o", folder / "tp1")
    two = cli("run", *args, "-o", folder / "tp2", "--tensor-parallel-size", 2)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    return model, inputs, outputs(folder / "tp1"), folder


@pytest.mark.slow
def test_run_job_tp2_equals_tp1_and_leaves_no_ranks(tp_job):
    model, _, ref, folder = tp_job
    assert outputs(folder / "tp2") == ref and len(ref) == 10
    assert wait_gone(rank_processes(model), timeout=5) == []


@pytest.mark.slow
def test_celery_worker_tp2_then_kill_9_of_its_pool_child(tp_job, start_worker, redis_server):
    """A worker owning two devices (BATCHSPEC_DEVICE=cpu,cpu) runs a job with TP=2, giving
    the TP=1 outputs; kill -9 of the pool child (rank 0) leaves no rank behind, and neither
    does kill -9 of the worker's process group."""
    model, inputs, ref, folder = tp_job
    url = redis_server.rsplit("/", 1)[0] + "/2"
    worker = start_worker("tp", url=url, BATCHSPEC_DEVICE="cpu,cpu")
    r = cli("submit", *inputs, "--model", model, "--max-tokens", 12, "--shard-size", 4,
            "-o", folder / "celery", "--wait", "-q", env={"BATCHSPEC_REDIS_URL": url})
    assert r.returncode == 0, r.stderr + worker.tail()
    assert outputs(folder / "celery") == ref
    [rank] = wait_until(lambda: rank_processes(model), 10, "the worker's rank process")
    with open(f"/proc/{rank}/stat") as f:
        rank_0 = int(f.read().rsplit(")", 1)[1].split()[1])   # the pool child
    os.kill(rank_0, signal.SIGKILL)
    assert wait_gone([rank], timeout=10) == []
    worker.kill()
    assert wait_gone(rank_processes(model), timeout=10) == []


@pytest.mark.slow
def test_a_worker_whose_step_hangs_exits_and_its_job_completes(tp_job, start_worker,
                                                              redis_server):
    """A tensor-parallel worker whose rank 1 is stopped (SIGSTOP) mid-job: rank 0's step
    waits in a collective while the thread renewing its lease lives on, which held the
    shard, and the job, for the collective's timeout (30 minutes). Past
    BATCHSPEC_STEP_TIMEOUT the pool process exits (one line in the log), the worker starts
    another, which runs the shard again with new ranks, and the job completes with the
    outputs of a TP=1 run, every row once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchspec.jobs.store import JobStore
    model, _, _, folder = tp_job
    src = folder / "long.parquet"
    pq.write_table(pa.table({"id": [f"l{i}" for i in range(8)],
                             "prompt": [f"row {i} of a long job" for i in range(8)]}), src)
    args = [src, "--model", model, "--max-tokens", 160, "--shard-size", 2]
    assert cli("run", *args, "-o", folder / "long1", "-q").returncode == 0
    url = redis_server.rsplit("/", 1)[0] + "/1"
    store = JobStore(url)
    store.r.flushdb()
    worker = start_worker("tp-stuck", url=url, BATCHSPEC_DEVICE="cpu,cpu",
                          BATCHSPEC_STEP_TIMEOUT="3", BATCHSPEC_LEASE_TTL="6",
                          BATCHSPEC_LEASE_RENEW="1", BATCHSPEC_CHECK_INTERVAL="1")
    waiting = subprocess.Popen(
        [sys.executable, "-m", "batchspec.cli", "submit", *map(str, args), "-o",
         str(folder / "stuck"), "--wait", "-q", "--broker", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = []
    try:
        job_id = wait_until(lambda: [j["job_id"] for j in store.recent(1)], 60, "the job")[0]
        wait_until(lambda: store.running_progress(job_id) and rank_processes(model), 120,
                   "a shard generating on two ranks", 0.02)
        stopped = rank_processes(model)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        _, stderr = waiting.communicate(timeout=240)
        assert waiting.returncode == 0, stderr + worker.tail()
        assert "this process is stuck" in worker.tail(100000)
        assert outputs(folder / "stuck") == outputs(folder / "long1")
        assert max(store.attempts(job_id, s) for s in store.shard_states(job_id)) == 2
    finally:
        for pid in stopped:       # (woken, a rank whose rank 0 is gone exits)
            os.kill(pid, signal.SIGCONT)
        if waiting.poll() is None:
            waiting.kill()
    assert wait_gone(stopped, timeout=10) == []
    worker.stop()


@pytest.mark.slow
def test_a_rank_killed_during_run_is_one_line_and_the_job_resumes(tp_job):
    """kill -9 of rank 1 while `batchspec run --tensor-parallel-size 2` decodes (rows of
    staggered lengths: the first shard is written while the others still run): one line on
    stderr saying which rank stopped and what to do, exit 1, no traceback; running the same
    command again finishes the job, every row once."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    model, _, _, folder = tp_job
    src = folder / "staggered.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(32)],
                             "prompt": [f"def f{i}(x):" for i in range(32)],
                             "max_tokens": [4 + 6 * i for i in range(32)]}), src)
    out = folder / "killed"
    args = ["run", src, "--model", model, "--shard-size", 4, "-q", "-o", out,
            "--tensor-parallel-size", 2]
    proc = subprocess.Popen([sys.executable, "-m", "batchspec.cli", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    [rank] = wait_until(lambda: rank_processes(model), 60, "the rank process")
    wait_until(lambda: os.path.isdir(out / "outputs") and os.listdir(out / "outputs"), 120,
               "a first shard", interval=0.01)
    os.kill(rank, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "tensor-parallel rank 1 stopped" in err, err
    assert "run the same command again" in err and len(err.strip().splitlines()) == 1, err
    assert len(read_dir(out, "outputs")) < 32
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert sorted(read_dir(out, "outputs").column("id").to_pylist()) == \
        sorted(f"r{i}" for i in range(32))
