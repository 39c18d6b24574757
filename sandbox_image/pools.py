"""One pool of worker processes per loaded reward function, and the scheduling of a batch across it.

Fast path: the batch is cut into one chunk per worker and each chunk runs as one task. When a chunk's worker
dies (crash) or outlives its hard deadline (a hang the soft timeouts could not interrupt), pebble kills and
replaces the worker, and the chunk's samples are re-run one per task so that only the guilty sample gets
``crash`` or ``timeout`` and the others keep their real scores.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Optional

from pebble import ProcessExpired, ProcessPool

from ..wire import DEFAULT_CONCURRENCY, DEFAULT_MAX_LOG_BYTES, DEFAULT_WORKERS, HARD_TIMEOUT_MARGIN_S, Status
from ..wire import TrainerState
from . import worker
from .records import BatchResult, FunctionInfo, Outcome, SampleBatch, WorkerConfig

log = logging.getLogger("rewardbox.sandbox")

_MP_CONTEXT = multiprocessing.get_context("forkserver")
# Workers fork from a clean server process that never ran gRPC threads; preloading keeps the fork cheap.
_MP_CONTEXT.set_forkserver_preload([worker.__name__])


@dataclass
class FunctionPool:
    """A loaded function version and the worker processes that serve it."""

    name: str
    filename: str
    function: str
    style: str
    source_sha256: str
    workers: int
    concurrency: int
    info: FunctionInfo = FunctionInfo(is_async=False)  # until describe() asked a worker
    pool: Optional[ProcessPool] = None
    registry_dir: str = ""
    in_flight: int = 0  # Score requests using this version (all on the server's event loop: no lock needed)
    retiring: bool = False

    @classmethod
    def start(
        cls,
        *,
        name: str,
        filename: str,
        source: str,
        function: str,
        style: str,
        workers: int = 0,
        concurrency: int = 0,
        max_log_bytes: int = 0,
    ) -> "FunctionPool":
        # Worker pids are registered here; the local backend kills their process groups when it stops us.
        registry_dir = tempfile.mkdtemp(prefix=f"{name[:20]}-", dir=os.environ.get("REWARDBOX_STATE_DIR"))
        config = WorkerConfig(
            name=name,
            filename=filename,
            source=source,
            function=function,
            style=style,
            concurrency=concurrency or DEFAULT_CONCURRENCY,
            max_log_bytes=max_log_bytes or DEFAULT_MAX_LOG_BYTES,
            registry_dir=registry_dir,
        )
        n = workers or DEFAULT_WORKERS
        pool = ProcessPool(max_workers=n, initializer=worker.init_worker, initargs=(config,), context=_MP_CONTEXT)
        return cls(
            name=name,
            filename=filename,
            function=function,
            style=style,
            source_sha256=hashlib.sha256(source.encode()).hexdigest(),
            workers=n,
            concurrency=config.concurrency,
            pool=pool,
            registry_dir=registry_dir,
        )

    async def describe(self, timeout_s: float = 60.0) -> FunctionInfo:
        """Checks the function as a worker loaded it (workers import in their initializer, before any task).

        Raises:
            worker.LoadError: the module or function cannot be used, or importing outlasted timeout_s.
        """
        future = self.pool.schedule(worker.describe_task, timeout=timeout_s)
        try:
            # The bound covers the initializer's import too, which pebble's task timeout does not.
            self.info = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except (FutureTimeout, asyncio.TimeoutError):
            raise worker.LoadError(f"{self.filename}: importing took longer than {timeout_s:.0f}s; a slow import "
                                   "needs a larger sandbox.start_timeout_s") from None
        except ProcessExpired as e:
            raise worker.LoadError(f"{self.filename}: the worker died while importing (exit code {e.exitcode})")
        except BrokenProcessPool:
            raise worker.LoadError(f"{self.filename}: every worker died while importing it (os._exit, a crash, or "
                                   "the memory limit at import time)") from None
        return self.info

    async def score(self, batch: SampleBatch, timeout_s: float, state: Optional[TrainerState]) -> BatchResult:
        """Scores a batch across the workers; one outcome per sample, in order. Never raises for user-code
        failures."""
        if not len(batch):
            return BatchResult()
        self.in_flight += 1
        try:
            return await self._score(batch, timeout_s, state)
        finally:
            self.in_flight -= 1
            if self.retiring and self.in_flight == 0:
                self.close(wait=True)

    async def _score(self, batch: SampleBatch, timeout_s: float, state: Optional[TrainerState]) -> BatchResult:
        # A batch-style function sees exactly the batch it was given (TRL rewards may compare within it).
        n_chunks = 1 if self.style == "batch" else min(self.workers, len(batch))
        bounds = [round(i * len(batch) / n_chunks) for i in range(n_chunks + 1)]
        chunks = [batch.slice(a, b) for a, b in zip(bounds, bounds[1:])]
        merged = BatchResult()
        for result in await asyncio.gather(*(self._score_chunk(c, timeout_s, state) for c in chunks)):
            merged.add(result)
        return merged

    def _hard_timeout(self, n: int, timeout_s: float) -> float:
        if self.style == "batch":
            per_call = 1
        elif self.info.is_async:
            per_call = -(-n // max(1, self.concurrency))
        else:
            per_call = n
        return per_call * timeout_s + HARD_TIMEOUT_MARGIN_S

    async def _run(self, batch: SampleBatch, timeout_s: float, state: Optional[TrainerState]):
        """(ChunkResult, None) when the worker answered, else (None, the Outcome of a killed or dead worker)."""
        future = self.pool.schedule(
            worker.score_task, args=(batch, timeout_s, state), timeout=self._hard_timeout(len(batch), timeout_s)
        )
        try:
            return await asyncio.wrap_future(future), None
        except FutureTimeout:
            return None, Outcome.failed(Status.TIMEOUT, f"exceeded timeout_s={timeout_s:g}; the worker was killed")
        except ProcessExpired as e:
            return None, Outcome.failed(Status.CRASH,
                                        f"worker process died (exit code {e.exitcode}, {_signal_name(e)})")

    async def _score_chunk(self, batch: SampleBatch, timeout_s: float, state: Optional[TrainerState]) -> BatchResult:
        done, failed = await self._run(batch, timeout_s, state)
        result = BatchResult()
        if done is not None:
            result.add(done)
            return result
        self.reap_orphans()
        result.workers_replaced = 1
        if len(batch) == 1:
            result.add_failed(failed)
            return result
        singles = await asyncio.gather(*(self._run(batch.slice(i, i + 1), timeout_s, state)
                                         for i in range(len(batch))))
        result.isolated_reruns = len(batch)
        for single_done, single_failed in singles:
            if single_done is not None:
                result.add(single_done)
            else:
                result.add_failed(single_failed)
                result.workers_replaced += 1
        self.reap_orphans()
        return result

    def reap_orphans(self) -> None:
        """Kills what dead workers left behind (a fork bomb's children would otherwise hold the pids limit)."""
        try:
            pids = os.listdir(self.registry_dir)
        except OSError:
            return
        for name in pids:
            pid = int(name)
            if _alive(pid):
                continue
            # The worker led its own process group; whatever is still in that group is an orphan of ours.
            for _ in range(20):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    break
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.registry_dir, name))

    def retire(self) -> None:
        """A newer version took over: stop the workers once the requests still using this one are done."""
        self.retiring = True
        if self.in_flight == 0:
            self.close(wait=True)

    def close(self, wait: bool) -> None:
        """Stops the workers: after in-flight tasks finish (``wait``) or at once."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        if wait:
            pool.close()
            threading.Thread(target=self._join_and_reap, args=(pool,), daemon=True).start()
        else:
            pool.stop()
            self._join_and_reap(pool)

    def _join_and_reap(self, pool: ProcessPool) -> None:
        with contextlib.suppress(Exception):
            pool.join(timeout=30)
        self.reap_orphans()
        shutil.rmtree(self.registry_dir, ignore_errors=True)


def _alive(pid: int) -> bool:
    fields = worker.proc_stat(pid)
    return fields is not None and fields[0] != "Z"  # a zombie has exited


def _signal_name(e: ProcessExpired) -> str:
    code = e.exitcode or 0
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return "exited"
