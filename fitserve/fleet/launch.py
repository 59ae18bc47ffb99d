"""``fitserve serve --replicas N``: start (or join) Ray, run the fleet's Serve application on
--port, roll its replicas over on ``POST /fleet/rollout`` or SIGHUP, and take it down on
SIGTERM/SIGINT (the Ray head too when this process started it).

A rollout redeploys the application with the replicas' next generation (their deployment
version): Serve's rolling update then replaces them a few at a time (max(1, 20%)), each
replaced replica taking no new request and finishing its running ones (streams too) before it
exits (builder.DRAIN_TIMEOUT_S at most), while the others answer.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

from fitserve.fleet.spec import FleetSpec

log = logging.getLogger("fitserve.fleet")


def run_fleet(spec: FleetSpec, host: str, port: int, ray_address: str | None = None) -> int:
    """Serve until a signal; 0 on a clean shutdown, 1 when the application failed to deploy."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print("fitserve serve --replicas: Ray Serve is not installed (pip install 'fitserve[ray]')")
        return 2
    from fitserve.fleet.builder import build_fitserve_app

    stop, hup = threading.Event(), threading.Event()

    def on_signal(sig: int, _frame: FrameType | None) -> None:
        (hup if sig == signal.SIGHUP else stop).set()

    started_head = ray_address is None
    if started_head:
        needed = sum(g.num_replicas * g.replica.num_cpus for g in spec.groups)
        cores = os.cpu_count() or 1
        if needed > cores:
            log.warning("%d replicas need %g CPUs: this machine's %d cores are oversubscribed",
                        spec.num_replicas, needed, cores)
        # NOTE: loopback only, no dashboard, a small object store: the fleet passes requests and
        # chunks through Ray, never tensors
        ray.init(num_cpus=max(cores, int(needed + 0.999)), include_dashboard=False, _node_ip_address="127.0.0.1",
                 object_store_memory=128 << 20, log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=ray_address, log_to_driver=False)
    # NOTE: after ray.init, which installs its own SIGTERM handler (it would end this process
    # at once, leaving Ray's agents behind)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    code = 0
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_fitserve_app(spec, generation=0), name=spec.name, route_prefix="/", blocking=False)
        print(f"fitserve: {spec.num_replicas} replicas of {spec.groups[0].replica.config.model} ready at "
              f"http://{host}:{port}", flush=True)
        _serve_rollouts(spec, stop, hup)
    except Exception as exc:  # noqa: BLE001 - a deploy failure is this command's exit status
        print(f"fitserve serve --replicas: the application failed: {exc}", flush=True)
        code = 1
    finally:
        _shutdown(spec.name, started_head)
        for s, handler in old.items():
            signal.signal(s, handler)
    return code


def _serve_rollouts(spec: FleetSpec, stop: threading.Event, hup: threading.Event) -> None:
    """Until ``stop``: redeploy with each generation the ingress is asked for (long poll)."""
    from ray import serve

    from fitserve.fleet.builder import build_fitserve_app

    ingress = serve.get_app_handle(spec.name)
    while not stop.is_set():
        try:
            if hup.is_set():
                hup.clear()
                ingress.rollout.remote().result(timeout_s=30)
            generation = ingress.take_rollout.remote(1.0).result(timeout_s=30)
        except Exception as exc:  # noqa: BLE001 - the ingress restarting: ask again
            log.warning("rollout poll failed: %s", exc)
            stop.wait(1.0)
            continue
        if generation is None:
            continue
        t0 = time.monotonic()
        print(f"fitserve: rolling update to generation {generation}", flush=True)
        try:
            serve.run(build_fitserve_app(spec, generation=generation), name=spec.name, route_prefix="/",
                      blocking=False)
        except Exception as exc:  # noqa: BLE001 - the old replicas keep serving
            print(f"fitserve: the rolling update to generation {generation} failed: {exc}", flush=True)
            continue
        print(f"fitserve: generation {generation} serving ({time.monotonic() - t0:.1f} s)", flush=True)


def _shutdown(app_name: str, started_head: bool) -> None:
    import ray
    from ray import serve

    t0 = time.monotonic()
    try:
        if started_head:
            serve.shutdown()
        else:
            serve.delete(app_name)  # a joined cluster keeps running; only our application goes
    finally:
        t1 = time.monotonic()
        ray.shutdown()
        log.info("shutdown: Serve %.1f s, Ray %.1f s", t1 - t0, time.monotonic() - t1)
