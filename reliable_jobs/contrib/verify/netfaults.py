"""A TCP proxy that can cut a server off: the PostgreSQL outage of the chaos run and the tests.

Stopping PostgreSQL would cut off every process on the machine, the chaos
run's own counting and other test databases included. A proxy in front of
it cuts off only the processes told to connect through it, with real
sockets: established connections are shut down (the client sees the peer go
away mid-query) and new ones are accepted and closed at once (the client
sees a refused handshake), which is what a database restart or a network
partition looks like from the worker.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttableProxy:
    """A TCP proxy to a server; ``cut()`` drops every connection and refuses new ones.

    ``stall()`` is the nastier fault: connections stay open and new ones are
    accepted, but nothing is forwarded until ``resume()``, as with a
    black-holed network path or a server stuck on a lock: a client waits,
    with no error to react to.
    """

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._down = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self.connections = 0
        threading.Thread(target=self._accept_loop, daemon=True, name="proxy-accept").start()

    @property
    def is_cut(self) -> bool:
        return self._down.is_set()

    def cut(self) -> None:
        self._down.set()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def restore(self) -> None:
        self._down.clear()

    def stall(self) -> None:
        """Stop forwarding in both directions; keep every connection open."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self.listener.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._down.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection((self.upstream_host, self.upstream_port),
                                                    timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets.update((client, upstream))
                self.connections += 1
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True,
                                 name="proxy-pump").start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                while not self._flowing.wait(0.1):
                    if self._closed.is_set() or self._down.is_set():
                        return
                target.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            # Each socket is the source of exactly one pump: closing it here
            # frees its descriptor once, however the pair ended.
            with self._lock:
                self._sockets.discard(source)
            source.close()
