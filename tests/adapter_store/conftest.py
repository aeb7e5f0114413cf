"""Fixtures of the adapter store's tests beside those of tests/conftest.py."""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlsplit

import pytest


class RedisProxy:
    """A loopback TCP proxy in front of Redis that counts client requests (bursts of bytes
    sent before waiting for a reply) and can go down and come back on the same port."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.requests = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.up()

    def up(self) -> None:
        if self._listener.fileno() == -1:
            self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            for sock in [self._listener, *self._sockets]:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if count:
                    with self._lock:
                        self.requests += 1
                dst.sendall(data)
        for sock in (src, dst):
            sock.close()


@pytest.fixture
def redis_proxy(redis_url):
    proxy = RedisProxy(urlsplit(redis_url.url).port)
    yield proxy
    proxy.down()
