"""A tiny HTTP server for test hosts: answers every GET with who it is and what was asked.

Standalone (stdlib only) so it can run inside a network namespace as
``python httpecho.py ADDRESS PORT``. It never resolves names, unlike ``http.server``,
which looks up its own FQDN at start and stalls in a namespace without DNS.
"""

from __future__ import annotations

import socketserver
import sys
from http.server import BaseHTTPRequestHandler


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"hello from {self.server.label} path {self.path}\n".encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: object) -> None:
        sys.stderr.write(f"{self.client_address[0]} {fmt % args}\n")


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    label = ""


def main() -> None:
    address, port = sys.argv[1], int(sys.argv[2])
    with Server((address, port), Handler) as server:
        server.label = f"{address}:{port}"
        print(f"listening on {address}:{port}", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    main()
