"""The engine thread: the only place the (non-thread-safe) Engine is touched.

::

    HTTP event loop (asyncio)                      engine thread
    ------------------------                       -------------
    submit(group) --.                              loop:
    abort(ids) -----+--> commands (queue.Queue) -->   idle?  block on commands.get()
                                                      drain every queued command
                                                      engine.step()
    per-request asyncio.Queue  <-- call_soon_threadsafe(outputs of this step)
    dashboard / metrics read   <-- snapshot published at most every 0.25 s and when idle

The HTTP side never waits on the engine (submit/abort only enqueue), and the engine never waits
on HTTP (delivery is a non-blocking hand-off to the event loop), so neither stalls the other.
When there is nothing to run, the thread blocks on the command queue: no busy polling.

Admission is counted atomically: :meth:`EngineLoop.submit` reserves one slot per request under
a lock, or refuses the whole group; the engine thread gives a slot back when its request leaves
the queue (first scheduled, aborted, failed or finished). Racing submits can then never put
more than ``max_waiting`` requests in the queue at once.

Failures are per request where possible: the Engine isolates a failing request inside a step
(it finishes with an error, the rest carry on); only a step that fails outside the model takes
down every live request. Client mistakes found by ``add_request`` (ValueError) are
:class:`RequestRejected` (400); anything else is internal (500, traceback logged).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fitserve.config import EngineConfig
from fitserve.engine.core import Engine, EngineStats
from fitserve.runner.placement import release_freed_host_memory
from fitserve.sampling.beam_search import BeamSearchParams
from fitserve.sched.slo import AdmissionRejected
from fitserve.server.engine_commands import (
    AbortCommand,
    AddCommand,
    Added,
    Child,
    EngineCommand,
    Sink,
    StopCommand,
)
from fitserve.server.metrics import EngineGauges, Metrics
from fitserve.server.snapshot import DashboardSnapshot
from fitserve.server.vllm_metrics import FinishedRequest
from fitserve.types import RequestOutput

log = logging.getLogger("fitserve.server")


class EngineShutdown(RuntimeError):
    """Delivered to requests still open when the engine thread stops."""


TRIM_DELAY_S = 0.5  # idle this long before the C heap is trimmed


class RequestRejected(ValueError):
    """The engine refused a request as invalid (``add_request`` raised ValueError): a 400."""


class EngineStepError(RuntimeError):
    """A request failed inside the engine (an internal error, logged with its traceback): a 500."""


@dataclass(slots=True)
class _Live:
    sink: Sink
    group: str
    arrival: float  # time.monotonic() when the HTTP request arrived
    prompt_len: int
    num_tokens: int = 0
    last_token_time: float | None = None
    scheduled: float | None = None  # start of the step that first scheduled it
    first_token_time: float | None = None


class EngineLoop:
    """Owns the Engine on a dedicated thread and exchanges commands/outputs with HTTP handlers."""

    def __init__(
        self,
        config: EngineConfig,
        metrics: Metrics,
        *,
        engine_factory: Callable[[EngineConfig], Engine] = Engine,
        snapshot_interval: float = 0.25,
        warm_up: bool = False,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.engine: Engine | None = None  # set once loaded; HTTP side reads only immutable facts
        self.error: BaseException | None = None
        self.snapshot: DashboardSnapshot | None = None
        self.gauges: EngineGauges | None = None
        self._factory = engine_factory
        self._warm_up = warm_up  # run every request path once before ready (fitserve.engine.warmup)
        self.on_load_error: Callable[[BaseException], None] | None = None
        self._interval = snapshot_interval
        self._cmds: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._queued = 0  # admission slots held: submitted requests not yet scheduled once
        self._queued_lock = threading.Lock()
        self._queued_ids: set[str] = set()  # engine thread only: live requests holding a slot
        self._ready = threading.Event()
        self._done = threading.Event()
        self._last_publish = 0.0
        self._thread = threading.Thread(target=self._run, name="fitserve-engine", daemon=True)

    # -- HTTP side ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        """True once the model is loaded and the loop is running."""
        return self._ready.is_set() and not self._done.is_set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._done.is_set()

    @property
    def queued(self) -> int:
        """Admission slots held: requests submitted and not yet scheduled for the first time."""
        return self._queued

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until loaded (True) or failed/timed out (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.is_set() and not self._done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._ready.wait(0.1 if left is None else min(0.1, left))
        return self.ready

    def submit(
        self, group: str, children: Sequence[Child], arrival: float, sink: Sink,
        max_queued: int | None = None, on_added: Added | None = None,
    ) -> bool:
        """Queue a group of requests; all are added or none (the sink then gets the error).

        ``on_added`` (called on the engine thread) hears which, once the engine has tried:
        a streaming response waits for it so that a refusal is still an HTTP status.

        With ``max_queued``, first reserve one admission slot per child, atomically: if that
        would make more than ``max_queued`` requests queued, nothing is queued and it returns
        False (the caller answers 503). Slots come back as the requests leave the queue.
        """
        with self._queued_lock:
            if max_queued is not None and self._queued + len(children) > max_queued:
                return False
            self._queued += len(children)
        self._cmds.put(AddCommand(group, list(children), arrival, sink, on_added))
        if self._done.is_set():
            self._refuse_pending()  # the thread is gone: nobody else will answer it
        return True

    def _release(self, n: int) -> None:
        if n:
            with self._queued_lock:
                self._queued -= n

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (unknown or finished ids are ignored) and free their blocks."""
        self._cmds.put(AbortCommand(list(request_ids)))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still open and end the thread."""
        if self._thread.is_alive():
            self._cmds.put(StopCommand())
            self._thread.join(timeout)

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        t0 = time.perf_counter()
        log.info("loading %s", self.config.model)
        try:
            self.engine = self._factory(self.config)
            if self._warm_up:
                from fitserve.engine.warmup import startup_summary, warm_up

                report = warm_up(self.engine)
                log.info("%s", startup_summary(self.engine, time.perf_counter() - t0, report))
                self.metrics.baseline(self._gauges(self.engine))  # the warm-up is not served work
        except BaseException as exc:  # noqa: BLE001 - reported through /health and the log
            self.error = exc
            log.error("model failed to load: %s", exc)
            self._done.set()
            if self.on_load_error is not None:
                self.on_load_error(exc)
            return
        self._ready.set()
        self.metrics.engine_alive.set(1)
        try:
            self._loop(self.engine)
        except BaseException as exc:  # noqa: BLE001 - the thread must report, not vanish
            self.error = exc
            log.error("engine loop died:\n%s", traceback.format_exc())
            self._fail_all(exc)
        finally:
            self.metrics.engine_alive.set(0)
            self._done.set()
            self._refuse_pending()
            self.engine.shutdown()  # the tensor-parallel workers, if any

    def _refuse_pending(self) -> None:
        """Answer every command nobody will run now (the thread ended): adds get a 503."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddCommand):
                self._release(len(cmd.children))
                err = EngineShutdown("the engine is not running")
                _deliver(cmd.sink, err)
                _tell(cmd.on_added, err)

    def _loop(self, engine: Engine) -> None:
        self._publish(engine, force=True)
        trim_due = False  # went idle since the last trim
        while True:
            if not engine.has_unfinished_requests():
                self._publish(engine, force=True)  # so an idle pool shows as empty at once
                cmd = self._next_idle_command(trim_due)  # blocks while idle
                trim_due = False
                if not self._handle(engine, cmd):
                    return
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if not self._handle(engine, cmd):
                    return
            if engine.has_unfinished_requests():
                trim_due = True
                self._step(engine)
            self._publish(engine)

    def _next_idle_command(self, trim_due: bool) -> EngineCommand:
        """Wait for a command; on the way, once idle, return freed C heap pages to the OS.

        NOTE: steps allocate tensors whose shapes follow the batch (n, chunk sizes, logprobs);
        glibc keeps the freed chunks resident, so without the trim the RSS at rest creeps up
        with the variety of shapes served and says little about what the server holds. The
        trim waits TRIM_DELAY_S of idleness, so a server between two requests does not pay it.
        """
        if trim_due:
            try:
                return self._cmds.get(timeout=TRIM_DELAY_S)
            except queue.Empty:
                release_freed_host_memory()
        return self._cmds.get()

    def _handle(self, engine: Engine, cmd: EngineCommand) -> bool:
        """Run one command; False once the loop must end."""
        match cmd:
            case AddCommand():
                self._add(engine, cmd)
            case AbortCommand(request_ids=request_ids):
                for rid in request_ids:
                    if self._live.pop(rid, None) is not None:
                        self.metrics.observe_finished("abort", None)
                    self._unqueue(rid)
                    engine.abort(rid)
            case StopCommand():
                for rid in list(self._live):
                    engine.abort(rid)
                self._fail_all(EngineShutdown("the server is shutting down"), "abort")
                self._publish(engine, force=True)
                return False
        return True

    def _add(self, engine: Engine, cmd: AddCommand) -> None:
        group, children, sink, on_added = cmd.group, cmd.children, cmd.sink, cmd.on_added
        added: list[str] = []
        try:
            for batch in cmd.prompt_runs():
                first = batch[0]
                if isinstance(first.params, BeamSearchParams):
                    engine.add_beam_search(first.prompt_ids, first.params, first.request_id)
                else:  # n samples of one prompt: one prefill, forked blocks
                    engine.add_requests(first.prompt_ids, [c.params for c in batch],  # type: ignore[misc]
                                        [c.request_id for c in batch], priority=first.priority,
                                        slo_ttft_ms=first.slo_ttft_ms, slo_tpot_ms=first.slo_tpot_ms)
                added.extend(c.request_id for c in batch)
        except Exception as exc:  # noqa: BLE001 - all or nothing: withdraw the group
            for rid in added:
                engine.abort(rid)
            self._release(len(children))
            err: BaseException
            if isinstance(exc, ValueError):
                err = RequestRejected(str(exc))
            elif isinstance(exc, AdmissionRejected):
                err = exc  # the server is busy, not the request wrong: a 429
            else:
                log.error("adding request group %s failed:\n%s", group, traceback.format_exc())
                err = EngineStepError(f"internal error: {type(exc).__name__} (see the server log)")
            _deliver(sink, err)
            _tell(on_added, err)
            return
        _tell(on_added, None)
        self.metrics.added.inc(len(children))
        for c in children:
            self._live[c.request_id] = _Live(sink, group, cmd.arrival, len(c.prompt_ids))
            self._queued_ids.add(c.request_id)
            self.metrics.prompt_tokens.inc(len(c.prompt_ids))

    def _step(self, engine: Engine) -> None:
        t_step, steps_before = time.monotonic(), engine.num_steps
        try:
            outputs = engine.step()
        except Exception as exc:  # noqa: BLE001 - not one request's fault: fail the batch, keep serving
            log.error("engine step failed outside the model; failing %d requests:\n%s",
                      len(self._live), traceback.format_exc())
            for rid in list(self._live):
                engine.abort(rid)
            self._fail_all(EngineStepError(f"internal error: {type(exc).__name__} (see the server log)"))
            return
        now = time.monotonic()
        if engine.num_steps > steps_before and engine.step_log:
            self.metrics.observe_step(engine.step_log[-1].new_tokens)
        # Requests scheduled for the first time (or finished/failed) have left the queue.
        for rid in [rid for rid in self._queued_ids if not engine.is_queued(rid)]:
            if (left := self._live.get(rid)) is not None and left.scheduled is None:
                left.scheduled = t_step
            self._unqueue(rid)
        batches: dict[int, tuple[Sink, list[RequestOutput]]] = {}
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if out.error is not None:
                log.error("request %s failed in an engine step; the others carry on",
                          out.request_id, exc_info=out.error)
            elif out.delta_token_ids:
                gap = None if live.last_token_time is None else now - live.last_token_time
                if live.last_token_time is None:
                    live.first_token_time = now
                    self.metrics.observe_ttft(now - live.arrival, live.prompt_len)
                self.metrics.observe_tokens(len(out.delta_token_ids), gap)
                live.last_token_time = now
            live.num_tokens = out.num_output_tokens
            if out.finished:
                del self._live[out.request_id]
                reason = out.finish_reason.value if out.finish_reason else "stop"
                self.metrics.observe_finished(reason, now - live.arrival, FinishedRequest(
                    reason, live.arrival, live.scheduled, live.first_token_time,
                    live.last_token_time, live.prompt_len, live.num_tokens))
            batches.setdefault(id(live.sink), (live.sink, []))[1].append(out)
        for sink, outs in batches.values():
            _deliver(sink, outs)

    def _unqueue(self, rid: str) -> None:
        """Give back the admission slot of a request that left the queue (no-op if it has none)."""
        if rid in self._queued_ids:
            self._queued_ids.discard(rid)
            self._release(1)

    def _fail_all(self, exc: BaseException, reason: str = "error") -> None:
        sinks = {id(v.sink): v.sink for v in self._live.values()}
        for _ in self._live:
            self.metrics.observe_finished(reason, None)
        self._release(len(self._queued_ids))
        self._queued_ids.clear()
        self._live.clear()
        for sink in sinks.values():
            _deliver(sink, exc)

    def _publish(self, engine: Engine, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_publish < self._interval:
            return
        self._last_publish = now
        st = engine.stats(with_owners=True)
        gauges = self._gauges(engine, st)
        self.metrics.set_gauges(gauges)
        rows = [(rid, live.group, live.prompt_len, live.num_tokens, live.arrival) for rid, live in self._live.items()]
        self.snapshot = DashboardSnapshot.of(st, engine.request_of, engine.config.cache.block_size, rows, now)
        self.gauges = gauges

    @staticmethod
    def _gauges(engine: Engine, st: EngineStats | None = None) -> EngineGauges:
        st = engine.stats() if st is None else st
        return EngineGauges(st.num_running, st.num_waiting, st.total_preemptions, st.kv, st.spec_decode,
                            st.slo_deprioritized, st.slo_step_time_correction, st.kv_block_bytes)


def _tell(on_added: Added | None, outcome: BaseException | None) -> None:
    if on_added is None:
        return
    try:
        on_added(outcome)
    except Exception:  # noqa: BLE001 - a closed event loop must not take the engine down
        log.debug("dropped an admission notice for a closed request", exc_info=True)


def _deliver(sink: Sink, item: list[RequestOutput] | BaseException) -> None:
    try:
        sink(item)
    except Exception:  # noqa: BLE001 - a closed event loop must not take the engine down
        log.debug("dropped an output for a closed request", exc_info=True)
