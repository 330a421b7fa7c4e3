"""The bubblewrap environment's holder, and the way each phase enters it, with no privilege needed.

    holder (inside the sandbox):  python -m gyre.harness.envd serve SOCKET LIFETIME_S
    phase  (on the host):         python -m gyre.harness.envd enter SOCKET [--cwd DIR] [--user U] -- ARGV

The holder listens on a unix socket in a folder bound into the sandbox. `enter` sends its argv, cwd,
user and environment with its own stdin, stdout and stderr (SCM_RIGHTS), the holder starts the
command inside (in the sandbox's mount, pid and network namespaces, as its child) and answers its
exit status; `enter` exits with it. When `enter` is killed (a budget, a timeout) its connection
closes and the holder kills the command's process group. What a command starts in a session of its
own (a service) keeps running until the holder ends, as in a Harbor container. nsenter could enter
the namespaces only as root: bubblewrap's unprivileged sandboxes refuse setns from outside.
"""

import argparse
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
import time

from gyre.common import jsonio
from gyre.common.files import publish

MAX_REQUEST = 1 << 20
"""Bytes of one request (argv, cwd, user, environment)."""
KILL_ALL = "__kill_all__"
"""A request's argv[0] that kills every process inside but the holder."""


def _user_ids(user: str) -> tuple[int, int]:
    entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid


def _kill_all() -> None:
    keep = {os.getpid(), 1}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in keep:
            try:
                os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass


def _run(conn: socket.socket) -> None:
    """One phase: start it with the client's fds, answer its exit status; a closed client kills it."""
    with conn:
        msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
        req = jsonio.loads(msg)
        if req["argv"][0] == KILL_ALL:
            for fd in fds:  # held, they would keep the client's pipes open after it exits
                os.close(fd)
            _kill_all()
            conn.sendall(b'{"exit": 0}')
            return
        ids = _user_ids(req["user"]) if req.get("user") else (None, None)
        try:
            proc = subprocess.Popen(
                req["argv"],
                cwd=req["cwd"],
                env=req["env"],
                stdin=fds[0],
                stdout=fds[1],
                stderr=fds[2],
                start_new_session=True,
                user=ids[0],
                group=ids[1],
                extra_groups=[] if ids[0] is not None else None,
            )
        except (OSError, KeyError, subprocess.SubprocessError) as e:
            os.write(fds[2], f"envd: cannot start {req['argv'][0]!r}: {e}\n".encode())
            conn.sendall(b'{"exit": 127}')
            return
        finally:
            for fd in fds:
                os.close(fd)
        threading.Thread(target=_watch_client, args=(conn, proc), daemon=True).start()
        code = proc.wait()
        try:
            conn.sendall(jsonio.dumps({"exit": code}).encode())
        except OSError:
            pass


def _watch_client(conn: socket.socket, proc: subprocess.Popen) -> None:
    """Kill the phase's process group once its client is gone (it sends nothing more)."""
    try:
        conn.recv(1)
    except OSError:
        pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass


def serve(path: str, lifetime_s: float) -> None:
    """Accept phases until `lifetime_s` has passed (then the sandbox ends with this process)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path + ".new")
    srv.listen(64)
    publish(path + ".new", path)  # the socket appears ready: the host waits for its name
    srv.settimeout(1.0)
    deadline = time.monotonic() + lifetime_s
    while time.monotonic() < deadline:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        threading.Thread(target=_run, args=(conn,), daemon=True).start()


def enter(path: str, argv: list[str], cwd: str, user: str | None) -> int:
    """Run `argv` inside through the holder at `path`; its exit status (128 + n: killed by signal n)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    req = {"argv": argv, "cwd": cwd, "user": user, "env": dict(os.environ)}
    socket.send_fds(conn, [jsonio.dumps(req).encode()], [0, 1, 2])
    reply = conn.recv(4096)
    if not reply:
        print("envd: the environment ended before the command did", file=sys.stderr)
        return 125
    code = jsonio.loads(reply)["exit"]
    return 128 - code if code < 0 else code


def main(args: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gyre.harness.envd", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("socket")
    s.add_argument("lifetime_s", type=float)
    e = sub.add_parser("enter")
    e.add_argument("socket")
    e.add_argument("--cwd", default="/")
    e.add_argument("--user")
    args = sys.argv[1:] if args is None else args
    cut = args.index("--") if "--" in args else len(args)  # the command follows `--`, flags and all
    a = p.parse_args(args[:cut])
    if a.cmd == "serve":
        serve(a.socket, a.lifetime_s)
        return
    sys.exit(enter(a.socket, args[cut + 1 :], a.cwd, a.user))


if __name__ == "__main__":
    main()
