"""The MPI backend (mpi4py + MPICH): dynamic processes joined by a port name published in a file.

    listener: MPI.Open_port() -> written to PORT_FILE; a thread loops COMM_SELF.Accept(port)
    peer:     reads PORT_FILE -> COMM_SELF.Connect(port)          one intercommunicator per peer

MPI's failure model is the risk: a process that dies is not reported by MPICH on an
intercommunicator (Iprobe on it keeps returning as if it were alive, verified with MPICH 5.0), and
a collective or a blocking send to it would hang. So every channel:
runs with MPI_ERRORS_RETURN, uses only nonblocking point-to-point calls (a send never waits for
the receiver; pending sends are completed lazily), sends a heartbeat every `heartbeat_s`, and
declares the peer dead (ChannelClosed) after `peer_timeout_s` of silence while it listens (a
caller busy elsewhere for a while does not count that time). Nothing spans more than
two processes; close() disconnects from a live peer (both sides do on goodbye) and only frees the
intercommunicator of a dead one.

Every MPI call of a process is made under one lock (`_CALLS`), and the process asks MPICH for
MPI_THREAD_SERIALIZED (checked with MPI.Query_thread()): threads take turns, MPICH never sees two
calls at once. Each call is short or bounded: Accept only for a peer that announced itself and with
an MPICH `timeout` (so a peer that died between announcing and connecting costs seconds, not the
process), Connect with one too (a handshake that fails is announced and tried again until the
connect timeout), Disconnect only once our sends are complete (MPICH ch4's disconnect is then a
local free; with sends still pending, a Free). At exit, the lock is taken for good before
mpi4py's MPI_Finalize, so no daemon thread (heartbeats) is inside MPI when it runs.

The network module is ch4:ofi over libfabric's tcp provider, chosen at MPI_Init (`_NETMOD_ENV`;
a variable already set wins: `cluster.mpi_provider` exports FI_PROVIDER to every process of the run,
so a site picks verbs, efa or cxi). MPICH 5.0.2's default, ch4:ucx, dies of SIGSEGV or SIGBUS inside
MPI_Comm_accept when peers reconnect again and again (tools/probe/mpi_stress.py --peers 3 --seconds
20 --hold-s 0.05: 9 of 9 runs on 2026-12-05, every call serialised, also with UCX_TLS=tcp,self or
sm,self or MPIR_CVAR_NOLOCAL=1), and the coordinator of a Slurm run died so once (2026-12-03).
ch4:ofi/tcp does not crash there (8 of 8 runs), but MPICH retries a send the provider cannot take
(its queue to a killed peer that had been talking) without end: Isend blocked under the lock and
starved every other channel. So each intercommunicator carries the `MPI_OFI_set_eagain` hint, and
MPICH gives up after `_EAGAIN_RETRIES` retries (~2 s on an idle core): the Isend returns
MPIX_ERR_EAGAIN and the channel declares its peer dead, well inside the other peers'
`peer_timeout_s` (tools/probe/mpi_kill.py). A killed peer that had been quiet is found by its
silence. History: with a lock per channel the coordinator once died of a segmentation fault while
accepting a leader as other threads sent and probed.

Processes started plainly are MPICH singletons; two singletons cannot connect to each other
(MPICH: "Local and remote groups ... are not disjoint"), so peers run under `mpiexec -n 1` (on
Slurm: their own `srun` step); the listener may be a singleton.
"""

import atexit
import os
import queue
import socket
import sys
import threading
import time
import uuid

from gyre.common.files import write_atomic
from gyre.common.wait import wait_until
from gyre.control.transport import Channel, ChannelClosed, ChannelTimeout, Listener, decode, encode
from gyre.errors import GyreError

_MSG, _HEARTBEAT, _BYE = 1, 2, 3
_BYE_SEEN = "the peer closed the channel"
_POLL_S = (0.00005, 0.005)  # recv polls Iprobe with a backoff from the first to the second
_CALLS = threading.Lock()  # every MPI call of this process (see above)
_ACCEPT_TIMEOUT_S = 10  # an announced peer's Connect arrives within ms; longer means it died
_EAGAIN_RETRIES = 100_000  # a send the provider cannot take for this long: its peer is presumed dead
_NETMOD_ENV = {
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "MPIR_CVAR_CH4_OFI_MAX_EAGAIN_RETRY": str(_EAGAIN_RETRIES),
}


class MpiThreadLevelError(GyreError):
    """The MPI library granted a thread level below MPI_THREAD_SERIALIZED."""


def _mpi():
    """mpi4py's MPI module, initialised for serialised calls from several threads (checked once)."""
    import mpi4py

    mpi4py.rc.thread_level = "serialized"  # read at the first import of mpi4py.MPI only
    # MPI_Init (the first import of mpi4py.MPI) reads these; children (engines) must not inherit them
    initialised = "mpi4py.MPI" in sys.modules
    chosen = {} if initialised else {k: v for k, v in _NETMOD_ENV.items() if k not in os.environ}
    os.environ.update(chosen)
    try:
        from mpi4py import MPI
    finally:
        for key in chosen:
            del os.environ[key]

    if not _mpi.checked:
        with _CALLS:
            granted = MPI.Query_thread()
        if granted < MPI.THREAD_SERIALIZED:
            raise MpiThreadLevelError(
                f"{MPI.Get_library_version().splitlines()[0]} granted thread level {granted}; the control "
                f"plane calls MPI from several threads (one at a time) and needs MPI_THREAD_SERIALIZED "
                f"({MPI.THREAD_SERIALIZED}): use cluster.control=tcp, or an MPI built with thread support"
            )
        atexit.register(_quiesce)
        _mpi.checked = True
    return MPI


_mpi.checked = False


def _quiesce() -> None:
    """At exit, before MPI_Finalize: take the lock for good, so no daemon thread is inside MPI then."""
    _CALLS.acquire(timeout=30)


def _timeout_info(MPI, timeout_s: float):
    """An MPI_Info with MPICH's `timeout` key (whole seconds, at least 1) for Accept and Connect."""
    info = MPI.Info.Create()
    info.Set("timeout", str(max(1, round(timeout_s))))
    return info


class MpiChannel(Channel):
    def __init__(self, comm, peer: str, heartbeat_s: float, peer_timeout_s: float):
        MPI = _mpi()
        with _CALLS:
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            hint = MPI.Info.Create()
            hint.Set("MPI_OFI_set_eagain", "true")  # a send bounded by _EAGAIN_RETRIES, never blocking
            comm.Set_info(hint)
            hint.Free()
        self._comm, self.peer = comm, peer
        self._heartbeat_s, self._peer_timeout_s = heartbeat_s, peer_timeout_s
        self._lock = _CALLS  # also guards this channel's state (pending sends, closed)
        self._pending: list = []  # (request, buffer): sends not known complete yet
        self._closed = False
        self._peer_gone: str | None = None
        self._last_heard = self._last_probe = time.monotonic()
        self._beat = threading.Thread(target=self._heartbeats, daemon=True, name=f"mpi-heartbeat-{peer}")
        self._beat.start()

    def _isend(self, data: bytes, tag: int) -> None:
        MPI = _mpi()
        with self._lock:
            if self._closed:
                raise ChannelClosed(f"{self.peer}: channel closed")
            try:
                self._pending.append((self._comm.Isend([data, MPI.BYTE], dest=0, tag=tag), data))
                self._pending = [(r, b) for r, b in self._pending if not r.Test()]
            except MPI.Exception as e:  # MPIX_ERR_EAGAIN: the provider took nothing to it for seconds
                self._peer_gone = f"send failed ({e.Get_error_string().split(', error stack')[0]}): presumed dead"
                raise ChannelClosed(f"{self.peer}: {self._peer_gone}") from None

    def send(self, msg: object) -> None:
        self._send_bytes(encode(msg))

    def _send_bytes(self, data: bytes) -> None:
        if self._peer_gone:
            raise ChannelClosed(f"{self.peer}: {self._peer_gone}")
        self._isend(data, _MSG)

    def _heartbeats(self) -> None:
        while not self._closed:
            try:
                self._isend(b"", _HEARTBEAT)
            except ChannelClosed:
                return
            time.sleep(self._heartbeat_s)

    def recv(self, timeout_s: float | None = None) -> object:
        MPI = _mpi()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = _POLL_S[0]
        while True:
            with self._lock:
                if self._closed:
                    raise ChannelClosed(f"{self.peer}: channel closed")
                try:
                    status = MPI.Status()
                    data = None
                    if self._comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=status):
                        data = bytearray(status.Get_count(MPI.BYTE))
                        self._comm.Recv([data, MPI.BYTE], source=0, tag=status.Get_tag())
                except MPI.Exception as e:
                    self._peer_gone = f"receive failed ({e.Get_error_string()})"
                    raise ChannelClosed(f"{self.peer}: {self._peer_gone}") from None
            now = time.monotonic()
            if now - self._last_probe > self._peer_timeout_s / 4:
                # nobody listened for a while (a busy caller): that is not the peer's silence, and
                # the first probes after it may come before MPICH's progress brings in what waits
                self._last_heard += now - self._last_probe
            self._last_probe = now
            if data is not None:
                self._last_heard, pause = now, _POLL_S[0]
                if status.Get_tag() == _BYE:
                    self._peer_gone = _BYE_SEEN
                    raise ChannelClosed(f"{self.peer}: {self._peer_gone}")
                if status.Get_tag() == _MSG:
                    return decode(bytes(data))
                continue  # a heartbeat
            if now - self._last_heard > self._peer_timeout_s:
                self._peer_gone = (
                    f"silent for {now - self._last_heard:.1f} s (heartbeat every {self._heartbeat_s} s): presumed dead"
                )
                raise ChannelClosed(f"{self.peer}: {self._peer_gone}")
            if deadline is not None and now >= deadline:
                raise ChannelTimeout(f"{self.peer}: nothing within {timeout_s} s")
            time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - now)))
            pause = min(pause * 2, _POLL_S[1])

    def close(self) -> None:
        """Say goodbye and disconnect from a live peer; a peer presumed dead, or sends that never
        complete, only free the intercommunicator locally (nothing here waits on the peer)."""
        if self._closed:
            return
        alive = self._peer_gone in (None, _BYE_SEEN)
        try:
            if self._peer_gone is None:
                self._isend(b"", _BYE)  # eager: delivered without waiting for the peer
        except ChannelClosed:
            alive = False
        with self._lock:
            self._closed = True
        MPI = _mpi()
        if alive:
            self._drain()
        with self._lock:
            try:
                if alive and not self._pending:
                    self._comm.Disconnect()  # MPICH ch4: a local free once our sends are complete
                else:
                    self._comm.Free()
            except MPI.Exception:
                pass

    def _drain(self, quiet_s: float = 0.05) -> None:
        """Receive what the peer still sent and finish our sends: Disconnect waits for both."""
        MPI = _mpi()
        quiet_since = deadline = time.monotonic()
        deadline += self._peer_timeout_s
        while (time.monotonic() - quiet_since < quiet_s or self._pending) and time.monotonic() < deadline:
            with self._lock:
                status = MPI.Status()
                if self._comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=status):
                    self._comm.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE], source=0, tag=status.Get_tag())
                    quiet_since = time.monotonic()
                self._pending = [(r, b) for r, b in self._pending if not r.Test()]
            time.sleep(_POLL_S[0])


class MpiListener(Listener):
    """Opens an MPI port and publishes its name in `port_file` (written atomically).

    MPI_Comm_accept waits for a peer and cannot be interrupted, and it holds the process's one MPI
    lock: a listener waiting in Accept would starve every channel it has. So Accept is called only
    for a peer that announced itself: `mpi_connect` drops a file into `<port_file>.join/`, then
    connects; the accept thread polls that folder. A peer that dies between the two costs at most
    `_ACCEPT_TIMEOUT_S` (MPICH's `timeout` info key), after which the listener serves the others.
    """

    def __init__(self, port_file: str, heartbeat_s: float = 0.5, peer_timeout_s: float = 5.0):
        MPI = _mpi()
        with _CALLS:
            self._port = MPI.Open_port()
            self._info = _timeout_info(MPI, _ACCEPT_TIMEOUT_S)
        self._port_file, self._join_dir = port_file, f"{port_file}.join"
        os.makedirs(self._join_dir, exist_ok=True)
        write_atomic(port_file, self._port)
        self.address = f"mpi:{port_file}"
        self._heartbeat_s, self._peer_timeout_s = heartbeat_s, peer_timeout_s
        self._accepted: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._count = 0
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="mpi-accept")
        self._thread.start()

    def _accept_loop(self) -> None:
        MPI = _mpi()
        while not self._closed.wait(0.02):
            for name in sorted(os.listdir(self._join_dir)):
                if name.startswith("."):
                    continue  # being written
                os.unlink(os.path.join(self._join_dir, name))
                try:
                    with _CALLS:  # short: the peer announced itself just before its Connect
                        comm = MPI.COMM_SELF.Accept(self._port, self._info)
                except MPI.Exception:
                    continue  # a failed handshake, or a peer that died after announcing: keep serving others
                # a channel (heartbeats) at once: the peer must hear us while `accept` is not called yet
                self._count += 1
                self._accepted.put(MpiChannel(comm, f"mpi peer {self._count}", self._heartbeat_s, self._peer_timeout_s))
        self._accepted.put(None)

    def accept(self, timeout_s: float | None = None) -> Channel:
        if self._closed.is_set():
            raise ChannelClosed("listener closed")
        try:
            channel = self._accepted.get(timeout=timeout_s)
        except queue.Empty:
            raise ChannelTimeout(f"no peer within {timeout_s} s") from None
        if channel is None:
            self._accepted.put(None)
            raise ChannelClosed("listener closed")
        return channel

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=30)
        while not self._accepted.empty():  # accepted, never taken: ours to close
            channel = self._accepted.get_nowait()
            if channel is not None:
                channel.close()
        self._accepted.put(None)
        with _CALLS:
            _mpi().Close_port(self._port)
            self._info.Free()
        for path in (self._port_file, *(os.path.join(self._join_dir, n) for n in os.listdir(self._join_dir))):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        os.rmdir(self._join_dir)


def mpi_connect(
    port_file: str, timeout_s: float = 30.0, heartbeat_s: float = 0.5, peer_timeout_s: float = 5.0
) -> Channel:
    """Connect to the listener whose port name is in `port_file` (waits for the file up to `timeout_s`).

    A handshake that fails is announced and tried again until `timeout_s`: under load the network
    may not take a handshake message within `_EAGAIN_RETRIES` (MPIX_ERR_EAGAIN), which the first
    Slurm run that met it took for a coordinator gone.

    Raises:
        ChannelClosed: no port file, or no listener accepted within `timeout_s`.
        MpiThreadLevelError: the MPI library cannot take calls from several threads.
    """
    MPI = _mpi()
    deadline = time.monotonic() + timeout_s  # bounds the connect below too
    if not wait_until(lambda: os.path.exists(port_file), timeout_s):
        raise ChannelClosed(f"no MPI port file {port_file} after {timeout_s} s")
    with open(port_file) as f:
        port = f.read().strip()
    while True:
        _announce(port_file)  # the listener calls Accept for us now
        with _CALLS:  # bounded by MPICH's connect timeout: no thread races it
            info = _timeout_info(MPI, max(1.0, deadline - time.monotonic()))
            try:
                comm = MPI.COMM_SELF.Connect(port, info)
            except MPI.Exception as e:
                comm, error = None, e.Get_error_string().split(", error stack")[0]
            finally:
                info.Free()
        if comm is not None:
            return MpiChannel(comm, f"mpi {port_file}", heartbeat_s, peer_timeout_s)
        if time.monotonic() >= deadline:
            raise ChannelClosed(f"cannot connect to {port_file} within {timeout_s} s: {error}")
        time.sleep(0.1)


def _announce(port_file: str) -> None:
    """Drop a file into the listener's join folder (written aside, then renamed into place)."""
    request = os.path.join(f"{port_file}.join", f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    write_atomic(request, f"{socket.gethostname()} {os.getpid()}\n")
