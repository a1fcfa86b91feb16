"""A tensor-parallel target: one process per rank, driven by rank 0.

Rank 0 is the engine's own process: the scheduler, the proposers (drafts run unsharded there),
verification, and rank 0's shard of the target. Ranks 1..N-1 are child processes
(`python -m batchspec.engine.distributed`) that hold their shard of the target and its KV
heads and run the same forward as rank 0, in step with it. Rank 0 sends each call (allocate
the KV cache, run a forward) down one pipe per rank before running it itself; the model's
collectives (batchspec.layers.parallel) go over a torch.distributed process group, gloo on
CPU and NCCL on CUDA, set up through a TCPStore that rank 0 serves on the loopback.

The pipes are also how a rank knows that rank 0 has gone: closing them (`close()`, garbage
collection, the end of the process) or rank 0's death (kill -9 included) ends every read
with EOF, and the rank exits. A watchdog thread also exits a rank whose parent changes (a
fork of rank 0 that kept a copy of a pipe). A rank that fails writes its error to the store
and exits; rank 0 then raises it."""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection

import torch

from batchspec.config import EngineConfig
from batchspec.engine.runner import ModelRunner
from batchspec.layers.parallel import TensorParallel

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600          # a rank that has not loaded its shard by then is given up on
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
STOP_TIMEOUT_S = 10
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_target_runner(config: EngineConfig) -> ModelRunner:
    """The target's runner: a TensorParallelRunner when tensor_parallel_size > 1."""
    if config.tensor_parallel_size > 1:
        return TensorParallelRunner(config.model, config.devices, config.dtype,
                                    config.attention_backend)
    return ModelRunner(config.model, config.device, config.dtype, config.attention_backend)


def new_group(store, rank: int, size: int, device: str):
    """The ranks' process group for the model's collectives: NCCL on CUDA, gloo on CPU."""
    store = torch.distributed.PrefixStore("tp", store)
    if device.startswith("cuda"):
        from torch.distributed import ProcessGroupNCCL
        torch.cuda.set_device(device)
        opts = ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        return ProcessGroupNCCL(store, rank, size, opts)
    from torch.distributed import ProcessGroupGloo
    opts = ProcessGroupGloo._Options()
    opts._timeout = COLLECTIVE_TIMEOUT
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return ProcessGroupGloo(store, rank, size, opts)


class TargetFailed(RuntimeError):
    """A tensor-parallel target stopped: a rank exited or a call failed mid-way. The engine
    is closed (its ranks may have stopped at different points of a step)."""


class TensorParallelRunner(ModelRunner):
    """Rank 0 of a target sharded over len(devices) ranks; the ModelRunner interface, with
    every call mirrored on the other ranks."""

    def __init__(self, path: str, devices: list[str], dtype: str, attention_backend: str):
        size = len(devices)
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                           wait_for_workers=False)
        self._store = store
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop_ranks, self._procs, self._conns)
        if devices[0] == "cpu":  # the ranks share the cores
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [PACKAGE_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        for rank in range(1, size):
            read_fd, write_fd = os.pipe()
            spec = dict(path=path, device=devices[rank], dtype=dtype, rank=rank, size=size,
                        attention_backend=attention_backend, port=store.port, fd=read_fd)
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "batchspec.engine.distributed", json.dumps(spec)],
                pass_fds=(read_fd,), env=env))
            os.close(read_fd)
            self._conns.append(Connection(write_fd, readable=False))
        self._wait_for("joined")
        tp = TensorParallel(0, size, new_group(store, 0, size, devices[0]))
        try:
            super().__init__(path, devices[0], dtype, attention_backend, tp)
        except BaseException:
            self._kill()
            raise
        self._wait_for("loaded")

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self._procs]

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _wait_for(self, stage: str) -> None:
        """Until every rank has reached `stage`; raises the error of a rank that exited."""
        keys = [f"{stage}/{r}" for r in range(1, len(self._procs) + 1)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._store.check(keys):
            failure = self._rank_failure(f"before it {stage}")
            if failure or time.monotonic() > deadline:
                self._kill()
                raise TargetFailed(failure or f"tensor-parallel ranks did not start within "
                                              f"{START_TIMEOUT_S} s")
            time.sleep(0.02)

    def _rank_failure(self, when: str) -> str | None:
        """What stopped the first rank that exited (the error it wrote, else its exit code);
        None while every rank runs."""
        for rank, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                key = f"error/{rank}"
                error = self._store.get(key).decode() if self._store.check([key]) else \
                    f"exit code {proc.returncode}"
                return f"tensor-parallel rank {rank} stopped {when}: {error}"
        return None

    def _call(self, method: str, *args):
        """Run `method` on every rank; rank 0's result."""
        if self.closed:
            raise TargetFailed("the tensor-parallel target was closed")
        try:
            for conn in self._conns:
                conn.send((method, args))
            return getattr(super(), method)(*args)
        except BaseException as e:
            # Report a rank that died first (a moment's grace for it to be reaped), then stop
            # them all at once: they may be waiting in a collective rank 0 will not reach.
            deadline = time.monotonic() + 1.0
            while isinstance(e, Exception) and time.monotonic() < deadline and \
                    all(p.poll() is None for p in self._procs):
                time.sleep(0.02)
            failure = self._rank_failure(f"during {method}")
            self._kill()
            if failure:
                raise TargetFailed(failure) from e
            if isinstance(e, Exception):
                raise TargetFailed(f"tensor-parallel {method} failed: {e}") from e
            raise

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        self.close()

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          prefault: bool = False) -> None:
        for conn in self._conns:  # the ranks use as many threads as rank 0 ends up with
            conn.send(("set_num_threads", (torch.get_num_threads(),)))
        self._call("allocate_kv_cache", num_blocks, block_size, prefault)

    def forward(self, token_rows, num_computed, block_tables, num_logits, float_logits=True):
        return self._call("forward", token_rows, num_computed, block_tables, num_logits,
                          float_logits)

    def close(self) -> None:
        """Stop ranks 1..N-1 (also done when this object is garbage collected)."""
        self._finalizer()


def _stop_ranks(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    for conn in conns:
        conn.close()                 # EOF: each rank leaves its loop and exits
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- ranks 1..N-1 ----------------------------------------------------------------------

def _exit_with_parent() -> None:
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def run_rank(spec: dict) -> None:
    """A rank's life: join the group, load its shard, then run what rank 0 sends until the
    pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    conn = Connection(spec["fd"], writable=False)
    rank = spec["rank"]
    store = torch.distributed.TCPStore("127.0.0.1", spec["port"], is_master=False,
                                       timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    try:
        store.set(f"joined/{rank}", "1")
        tp = TensorParallel(rank, spec["size"],
                            new_group(store, rank, spec["size"], spec["device"]))
        runner = ModelRunner(spec["path"], spec["device"], spec["dtype"],
                             spec["attention_backend"], tp)
        store.set(f"loaded/{rank}", "1")
        while True:
            try:
                method, args = conn.recv()
            except EOFError:
                break
            if method == "set_num_threads":
                torch.set_num_threads(*args)
            else:
                getattr(runner, method)(*args)
    except Exception as e:
        log.exception("tensor-parallel rank %d failed", rank)
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        os._exit(1)
    os._exit(0)  # no interpreter teardown: the process group's peers may be gone


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    run_rank(json.loads(sys.argv[1]))
