"""TCPStores that listen on one address, not on every interface: the rendezvous of the trainer world and of the
weight-sync groups.

Stage: weight sync / process groups (imports nothing of ours; pg.py and the trainer's `train/dist.py` use it).
A torch `TCPStore` is an unauthenticated key-value server: anyone who reaches its port can read and write the keys
every rank trusts (the collective sequence numbers, NCCL's unique id, gloo's peer addresses). Created as torch's
`tcp://` rendezvous creates it, its server binds the wildcard address (`::`, every interface). Here the master binds
a socket to the address its peers connect to and hands it to the store (`master_listen_fd`), so a store of a run on
one machine (127.0.0.1) is reachable from this machine only, and one on a cluster node only on the address the
other nodes use. Clients are plain `TCPStore` clients: SGLang's `init_weights_update_group` (torch's `tcp://`
rendezvous, a client) joins such a store as it joins any.

Invariants:
- The listening socket belongs to the store once handed over: torch closes it with the store (both TCPServer
  backends, libuv and the legacy one, accept `master_listen_fd` and close it themselves); we hand over a duplicate
  and close our own, so no descriptor is closed twice.
- A host name that resolves to a loopback address although it is not a loopback name (Debian's ``127.0.1.1 node01``
  line for the machine's own name) cannot be what remote peers connect to: the master then binds every interface,
  as torch would, and logs a warning naming the host, rather than leave remote peers unable to join.
- Gloo's own data-plane sockets are not the store's: gloo binds one address, that of the device it is given
  (default: this host name's address, or ``GLOO_SOCKET_IFNAME``'s interface), never the wildcard.
  :func:`gloo_device` keeps a group whose master is a loopback address on loopback.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from typing import Any

import torch.distributed as dist

__all__ = ["client_store", "gloo_device", "is_loopback", "listen_socket", "master_store", "process_group_kwargs"]

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback literal (127.0.0.0/8, ::1) or ``localhost``."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bind_target(host: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    """(family, sockaddr) the master binds for ``host``: its first TCP address, or the wildcard (module invariants)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve the store host {host!r}: {e}") from e
    infos = [i for i in infos if i[0] in (socket.AF_INET, socket.AF_INET6)]
    if not infos:
        raise OSError(f"the store host {host!r} has no IPv4 or IPv6 address")
    family, _, _, _, sockaddr = infos[0]
    if ipaddress.ip_address(str(sockaddr[0]).split("%")[0]).is_loopback and not is_loopback(host):
        log.warning(
            "TCPStore host %r resolves to the loopback address %s on this machine, which peers on other machines "
            "cannot reach: the store listens on every interface (fix the host's name resolution, or give its "
            "address, to keep it on one)",
            host,
            sockaddr[0],
        )
        return (socket.AF_INET, ("0.0.0.0", port)) if family == socket.AF_INET else (socket.AF_INET6, ("::", port))
    return family, sockaddr


def listen_socket(host: str, port: int = 0, backlog: int = 128) -> socket.socket:
    """A TCP socket bound to ``host``'s address (see module invariants) at ``port`` (0: a free one), listening."""
    family, sockaddr = _bind_target(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own TCPServer does
        if family == socket.AF_INET6 and sockaddr[0] == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # the wildcard: IPv4 peers too
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for a TCPStore: {e.strerror or e}") from e
    return sock


def master_store(
    host: str, port: int, world_size: int | None, timeout_s: float, *, wait_for_workers: bool = True
) -> dist.TCPStore:
    """The store's server (rank 0), listening on ``host``'s address only. ``port`` 0 picks a free one (read it
    back from ``.port``). With ``wait_for_workers`` (and a ``world_size``) this blocks until every client has
    connected, as torch's ``tcp://`` rendezvous does; a client missing after ``timeout_s`` fails it."""
    sock = listen_socket(host, port)
    bound_port = int(sock.getsockname()[1])
    fd = os.dup(sock.fileno())  # the store owns and closes this one (module invariants)
    sock.close()
    return dist.TCPStore(
        host,  # the master's own client connects here, so the address it listens on
        bound_port,
        world_size,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=wait_for_workers,
        master_listen_fd=fd,
    )


def client_store(host: str, port: int, world_size: int | None, timeout_s: float) -> dist.TCPStore:
    """A client of the store at ``host:port`` (retries until the server listens, for up to ``timeout_s``)."""
    return dist.TCPStore(
        host, port, world_size, False, datetime.timedelta(seconds=timeout_s), wait_for_workers=world_size is not None
    )


def process_group_kwargs(host: str, port: int, *, rank: int, world_size: int, timeout_s: float) -> dict[str, Any]:
    """``dist.init_process_group(backend=..., timeout=..., **process_group_kwargs(...))`` in place of
    ``init_method="tcp://host:port"``: rank 0 serves the store on ``host``'s address only, the others connect.
    Every rank of the world must use it (the ``tcp://`` path nests the keys under another prefix)."""
    if rank == 0:
        store = master_store(host, port, world_size, timeout_s)
    else:
        store = client_store(host, port, world_size, timeout_s)
    return {"store": store, "rank": rank, "world_size": world_size}


def gloo_device(master_host: str) -> Any | None:
    """A gloo device on loopback when the group's master is a loopback address (every member is then on this
    machine, so its data-plane sockets need no other interface); None: gloo's default device (this host name's
    address, or ``GLOO_SOCKET_IFNAME``'s interface)."""
    if not is_loopback(master_host):
        return None
    address = "::1" if ":" in master_host else "127.0.0.1"
    return dist.ProcessGroupGloo.create_device(hostname=address)
