"""A TCP echo server for site hosts: ``python3 tcpecho.py ADDRESS PORT``.

Each connection gets back what it sends; after the client's EOF the server half-closes too, so
a client sees the end of the echo only once everything it sent came back."""

from __future__ import annotations

import socket
import sys
import threading


def echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)


def main() -> None:
    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
