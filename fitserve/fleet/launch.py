"""``fitserve serve --replicas N``: start (or join) Ray, run the fleet's Serve application on
--port, and take it down on SIGTERM/SIGINT (the Ray head too when this process started it)."""

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

    stop = threading.Event()

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

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
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_fitserve_app(spec), name=spec.name, route_prefix="/", blocking=False)
        print(f"fitserve: {spec.num_replicas} replicas of {spec.groups[0].replica.config.model} ready at "
              f"http://{host}:{port}", flush=True)
        stop.wait()
    except Exception as exc:  # noqa: BLE001 - a deploy failure is this command's exit status
        print(f"fitserve serve --replicas: the application failed: {exc}", flush=True)
        code = 1
    finally:
        _shutdown(spec.name, started_head)
        for s, handler in old.items():
            signal.signal(s, handler)
    return code


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
