"""The launcher-exec of ``python -m pytest_sprite hosts``: what ``ssh HOST COMMAND`` is on a cluster (stdlib only).

MPICH's hydra calls it as ``rsh [-x] HOST COMMAND...`` (its ssh launcher's words) to start its proxy on a
host. It connects over the run's network to HOST's daemon (``_hostd.py``), which starts COMMAND there with
``sh -c``, as sshd would; the command's output comes back here and its exit status is this process's.

Run by path with the run's table as first argument: ``python _rsh.py TABLE.json [-x] HOST COMMAND...``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys


def _read_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the host's daemon closed the connection")
        data += chunk
    return data


def main(argv: list[str]) -> int:
    table_path, *words = argv
    while words and words[0].startswith("-"):  # ssh options hydra adds (-x: no X11 forwarding)
        words.pop(0)
    if len(words) < 2:
        print("usage: rsh [-x] HOST COMMAND...", file=sys.stderr)
        return 255
    host, command = words[0], " ".join(words[1:])
    with open(table_path, encoding="utf-8") as fh:
        table = json.load(fh)
    port = table["ports"].get(host)
    if port is None:
        print(f"rsh: {host!r} is not a host of this run ({', '.join(table['ports'])})", file=sys.stderr)
        return 255
    try:
        conn = socket.create_connection((host, port), timeout=30)  # resolved as ssh would: /etc/hosts
    except OSError as exc:
        print(f"rsh: cannot reach {host}:{port}: {exc}", file=sys.stderr)
        return 255
    conn.settimeout(None)
    request = {"token": table["token"], "argv": ["sh", "-c", command], "cwd": os.getcwd()}
    conn.sendall(json.dumps(request).encode() + b"\n")
    out = sys.stdout.buffer
    try:
        while True:
            kind = _read_exact(conn, 1)
            (size,) = struct.unpack("!I", _read_exact(conn, 4))
            payload = _read_exact(conn, size)
            if kind == b"o":
                out.write(payload)
                out.flush()
            else:
                status = int(payload)
                return 128 - status if status < 0 else status
    except (ConnectionError, OSError) as exc:
        print(f"rsh: lost the connection to {host}: {exc}", file=sys.stderr)
        return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
