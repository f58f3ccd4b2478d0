"""Several `/retrieve` server processes on one port: `WorkerPool` and `serve_workers`.

One Python process answers HTTP and runs the retriever under one GIL, so it uses about one core
however many clients there are. A `WorkerPool` starts ``workers`` server processes on one port (on
Linux each with its own ``SO_REUSEPORT`` listening socket: the kernel spreads connections over them).
Each worker loads the index itself, a BM25 index memory-mapped (``mmap=True``), so the score arrays
are one copy in the page cache shared by all workers; the passages and the vocabulary are per worker.
Each worker batches its own concurrent requests (`MicroBatcher`).

Errors are visible and fatal: a worker that cannot load the index reports the error, and the
pool stops the others; a worker that dies while serving stops the whole pool (`serve_workers`
returns 1), so a half-dead server never keeps answering. Workers exit when the pool stops, and a
worker whose parent has died exits within a second: no orphans.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from stratarl.extensions import load_extensions, loaded_extensions
from stratarl.retrieval.factory import build_retriever
from stratarl.retrieval.index_files import read_index_meta
from stratarl.retrieval.protocol import ServerLimits
from stratarl.retrieval.server import create_app
from stratarl.retrieval.slow_clients import DEFAULT_REQUEST_TIMEOUT_S, check_request_timeout, request_timeout_protocol

logger = logging.getLogger("stratarl.server")


class WorkerError(RuntimeError):
    """A worker process failed to start or died; the message names the worker and the cause."""


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)  # the pool's process is gone: nobody will stop this worker


def _listening_socket(host: str, port: int, *, reuse_port: bool, backlog: int = 2048) -> socket.socket:
    # proto=IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets whose proto
    # says TCP; with 0 every small response waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if backlog:
        sock.listen(backlog)
    return sock


def _worker_main(config: dict) -> int:
    """One worker process (``python -m stratarl.retrieval.workers CONFIG``): load the retriever, then serve
    until SIGTERM / SIGINT. Reports ``ready`` or its error as one JSON line on the status pipe."""
    threading.Thread(target=_watch_parent, args=(config["parent_pid"],), daemon=True).start()
    status = os.fdopen(config["status_fd"], "w", buffering=1)

    def report(kind: str, detail) -> None:
        status.write(json.dumps({"worker": config["index"], "kind": kind, "detail": detail}) + "\n")

    try:
        import torch  # here, in the worker: the pool's parent process does not load torch
        import uvicorn  # here, in the worker: the pool's parent process does not load uvicorn

        torch.set_num_threads(config["threads"])  # N workers x all cores each would oversubscribe the machine
        if "fd" in config:
            sock = socket.socket(fileno=config["fd"])
        else:
            sock = _listening_socket(config["host"], config["port"], reuse_port=True)
        load_extensions(config.get("imports", []))  # the parent's --import modules: a kind of the user's own
        retriever = build_retriever(config["spec"])
        app = create_app(retriever, **config["limits"], **config["server_options"])
        uvicorn_config = uvicorn.Config(
            app,
            log_level=config["log_level"],
            lifespan="on",
            timeout_graceful_shutdown=5,
            http=request_timeout_protocol(config["request_timeout_s"]),
        )
        server = uvicorn.Server(uvicorn_config)
    except Exception as error:  # noqa: BLE001  any start-up failure goes to the parent as one line (exit 2)
        report("error", f"{type(error).__name__}: {error}")
        return 2

    def report_started() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.01)
        if server.started:
            report("ready", os.getpid())

    threading.Thread(target=report_started, daemon=True).start()
    server.run(sockets=[sock])
    return 0


def _mapped(spec):
    """``spec`` with ``mmap: True`` added when it loads a saved BM25 index (so workers share its pages)."""
    if isinstance(spec, (str, Path)) and Path(spec).is_dir():
        spec = {"index": str(spec)}
    if isinstance(spec, dict) and "index" in spec and "corpus" not in spec:
        kind = spec.get("kind") or read_index_meta(spec["index"])["kind"]
        if kind == "bm25":
            return {"mmap": True, **spec, "kind": "bm25"}
    return spec


class WorkerPool:
    """``workers`` server processes on one port ``host:port`` (port 0 = a free one).

    ``spec`` is a `build_retriever` spec (JSON-able) each worker loads; a saved BM25 index is loaded
    memory-mapped. On Linux each worker listens on its own ``SO_REUSEPORT`` socket, so the kernel
    spreads connections evenly over the workers (with one shared socket, the worker that wakes first
    accepts a whole burst of connections); elsewhere they share one inherited socket. Workers are
    ``python -m stratarl.retrieval.workers`` subprocesses (not multiprocessing: no ``__main__`` guard
    needed in the caller's script); their logs go to this process's stderr. ``start`` returns once every
    worker answers, or raises `WorkerError` with the first worker's error; ``stop`` ends every worker
    (SIGTERM, then SIGKILL after ``stop_timeout_s``). ``with WorkerPool(spec, workers=2) as pool: pool.url``.
    """

    def __init__(
        self,
        spec,
        *,
        workers: int = 2,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        limits: ServerLimits | None = None,
        threads_per_worker: int | None = None,
        start_timeout_s: float = 600.0,
        stop_timeout_s: float = 10.0,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        **server_options,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        self.request_timeout_s = check_request_timeout(request_timeout_s)  # fails here, not in every worker
        self.spec = _mapped(spec)
        self.workers = workers
        self.host = host
        self.port = port
        self.log_level = log_level
        self.limits = limits or ServerLimits()
        self.threads_per_worker = threads_per_worker or max(1, (os.cpu_count() or 1) // workers)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.server_options = server_options
        self.processes: list[subprocess.Popen] = []
        self._sock: socket.socket | None = None
        self._status_fd: int | None = None
        self._stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def start(self) -> WorkerPool:
        reuse_port = hasattr(socket, "SO_REUSEPORT") and sys.platform.startswith("linux")
        # With SO_REUSEPORT this socket only holds the port (it never listens); the workers listen.
        self._sock = _listening_socket(self.host, self.port, reuse_port=reuse_port, backlog=0 if reuse_port else 2048)
        self.port = self._sock.getsockname()[1]
        read_fd, write_fd = os.pipe()
        self._status_fd = read_fd
        base = {
            "spec": self.spec,
            "limits": asdict(self.limits),
            "log_level": self.log_level,
            "threads": self.threads_per_worker,
            "parent_pid": os.getpid(),
            "status_fd": write_fd,
            "server_options": self.server_options,
            "request_timeout_s": self.request_timeout_s,
            "imports": loaded_extensions(),
        }
        base.update({"host": self.host, "port": self.port} if reuse_port else {"fd": self._sock.fileno()})
        pass_fds = (write_fd,) if reuse_port else (write_fd, self._sock.fileno())
        write_fd_open = True
        try:
            for index in range(self.workers):
                command = [sys.executable, "-m", "stratarl.retrieval.workers", json.dumps({**base, "index": index})]
                self.processes.append(subprocess.Popen(command, pass_fds=pass_fds))
            os.close(write_fd)
            write_fd_open = False
            self._wait_ready()
        except BaseException:
            if write_fd_open:
                os.close(write_fd)
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        ready: set[int] = set()
        buffer = b""
        status_fd = self._status_fd
        if status_fd is None:
            raise RuntimeError("the worker pool has no status pipe: start() opens it")
        deadline = time.monotonic() + self.start_timeout_s
        while len(ready) < self.workers:
            readable, _, _ = select.select([status_fd], [], [], 0.2)
            if readable:
                chunk = os.read(status_fd, 65536)
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    message = json.loads(line)
                    if message["kind"] == "error":
                        raise WorkerError(f"server worker {message['worker']} failed to start: {message['detail']}")
                    ready.add(message["worker"])
                if chunk:
                    continue
            for index, process in enumerate(self.processes):
                if index not in ready and process.poll() is not None:
                    raise WorkerError(
                        f"server worker {index} exited with code {process.returncode} before it "
                        "started; its error is above"
                    )
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"{self.workers - len(ready)} server worker(s) did not start within {self.start_timeout_s:.0f} s"
                )

    def wait(self) -> int:
        """Block until a worker exits (then stop the others) → 1, or until `stop` was called → 0."""
        while self.processes and not self._stopping.is_set():
            for index, process in enumerate(self.processes):
                if process.poll() is not None and not self._stopping.is_set():
                    logger.error(
                        "server worker %d (pid %d) exited with code %s; stopping the server",
                        index,
                        process.pid,
                        process.returncode,
                    )
                    self.stop()
                    return 1
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        """SIGTERM every worker (uvicorn finishes open requests), SIGKILL those still running after the timeout."""
        self._stopping.set()
        processes, self.processes = self.processes, []
        for process in processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + self.stop_timeout_s
        for process in processes:
            try:
                process.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._status_fd is not None:
            os.close(self._status_fd)
            self._status_fd = None

    def __enter__(self) -> WorkerPool:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def serve_workers(
    spec,
    *,
    workers: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    on_ready=None,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
) -> int:
    """Serve ``spec`` with ``workers`` processes until SIGINT / SIGTERM (→ 0) or a worker dies (→ 1).

    Raises `WorkerError` if a worker cannot start. ``on_ready(pool)`` is called once all answer."""
    pool = WorkerPool(
        spec,
        workers=workers,
        host=host,
        port=port,
        log_level=log_level,
        limits=limits,
        request_timeout_s=request_timeout_s,
    )

    def on_signal(signum, frame) -> None:
        pool._stopping.set()  # a worker that exits on the same Ctrl-C is not a failure
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        pool.start()
        if on_ready is not None:
            on_ready(pool)
        return pool.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        pool.stop()


if __name__ == "__main__":
    sys.exit(_worker_main(json.loads(sys.argv[1])))
