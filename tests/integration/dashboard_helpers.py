"""The dashboard as a real uvicorn server on loopback, for the dashboard tests."""

from __future__ import annotations

import pathlib
import shutil
import threading
import time
from typing import Any

import uvicorn

from awa_fast.web import create_app
from awa_fast.web.backend import Backend
from awa_fast.web.security import load_or_create_token

CHROMIUM = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if pathlib.Path(p).exists()),
                shutil.which("chromium") or shutil.which("chromium-browser"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class DashboardServer:
    """``awa-fast serve``'s ASGI app under uvicorn on 127.0.0.1, an ephemeral port, on a thread."""

    def __init__(self, app: Any, dsn: str, home: pathlib.Path | None, token_file: pathlib.Path, *,
                 read_only: bool = False) -> None:
        self.token = load_or_create_token(token_file)
        self.backend = Backend(app, dsn, home, sample_every=0.5)
        self.backend.start()
        config = uvicorn.Config(create_app(self.backend, token=self.token, read_only=read_only),
                                host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="dashboard", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError("the dashboard server did not start")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.backend.close()

    def __enter__(self) -> DashboardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
