"""Running the HTTP app (http.py) with uvicorn: `serve` in the foreground (`python -m qwen_mtp serve`), with
SIGTERM / Ctrl-C handled, and `serve_in_thread` on an ephemeral port of 127.0.0.1 (the tests, the benchmark).

SIGTERM (or the first Ctrl-C): /health turns 503 and new requests get 503, the listening socket closes (no new
connections), requests already running finish (their streams too) for up to `shutdown_timeout` seconds, then
those still running are cancelled (their engine requests freed) and the process exits. A second Ctrl-C exits at
once.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_TIMEOUT = 30.0


def folder_defaults(model_path) -> dict:
    """Sampling defaults from the model folder's generation_config.json, used where a request leaves a field out
    (as vLLM does): do_sample false -> temperature 0 (greedy); else its temperature, top_p, top_k; and its
    repetition_penalty. Fields the file lacks keep the OpenAI defaults (temperature 1, top_p 1, no top-k)."""
    from qwen_mtp.loading.folder import generation_repetition_penalty

    out = {}
    penalty = generation_repetition_penalty(model_path)  # checked reading, a bad file is a ConfigError
    if penalty is not None:
        out["repetition_penalty"] = penalty
    file = Path(model_path) / "generation_config.json"
    if not file.is_file():
        return out
    data = json.loads(file.read_text(encoding="utf-8"))
    if data.get("do_sample") is False:
        out["temperature"] = 0.0
    else:
        for key, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
            value = data.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = kind(value)
    return out


def _server(app, *, log_level: str, shutdown_timeout: float):
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.server.draining = True  # /health 503, new requests 503, while running ones finish
            super().handle_exit(sig, frame)
            # uvicorn re-raises a caught signal once it has shut down, which would end the process before the
            # caller stops its engine: the shutdown is done here, so `serve` returns instead
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            lifespan="off", access_log=False)
    return Server(config)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(app, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, log_level: str = "info",
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, on_ready=None) -> None:
    """Serve until SIGTERM / Ctrl-C (see the module docstring). on_ready(port) is called once listening."""
    server = _server(app, log_level=log_level, shutdown_timeout=shutdown_timeout)
    sock = _bind(host, port)
    if on_ready is not None:
        on_ready(sock.getsockname()[1])
    server.run(sockets=[sock])


class ThreadServer:
    """The app served on a thread (127.0.0.1 and an ephemeral port unless told otherwise): .url, .port, .stop()."""

    def __init__(self, app, host: str = DEFAULT_HOST, port: int = 0, shutdown_timeout: float = 5.0):
        self.app = app
        self.server = _server(app, log_level="warning", shutdown_timeout=shutdown_timeout)
        self.sock = _bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="qwen-mtp-http", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """What SIGTERM does to `serve`: drain, then stop."""
        self.app.state.server.draining = True
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
