"""Rendezvous stores that listen on loopback only, for single-node runs.

torch's c10d `TCPStore` server listens on every interface whatever host it is given, so anyone
who can reach the machine could read and write the run's keys. Its `master_listen_fd` option
takes a socket the caller bound instead; meshplan binds that socket to the loopback address for
both stores of a single-node run:

- the torchrun agent's rendezvous store: `python -m meshplan.executor.loopback` runs torchrun
  (`torch.distributed.run`) with the c10d rendezvous backend's store made by `tcp_store`;
- rank 0's process-group store: the worker builds it with `worker_store` when the master
  address (torchrun's `--local-addr`) is a loopback address.

Multi-node runs (a master address that is not loopback) keep torch's own stores.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
from datetime import timedelta

LOOPBACK = "127.0.0.1"
LISTEN_BACKLOG = 128


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _bound_socket(host: str, port: int) -> tuple[int, int]:
    """A listening IPv4 socket on `host`:`port` (0: any free port): (file descriptor, port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((socket.gethostbyname(host), port))
        sock.listen(LISTEN_BACKLOG)
        bound_port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return sock.detach(), bound_port


def tcp_store(host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
              timeout: timedelta = timedelta(seconds=300), wait_for_workers: bool = True,
              multi_tenant: bool = False, master_listen_fd: int | None = None, use_libuv: bool = True):
    """`torch.distributed.TCPStore`, whose server (is_master) listens only on `host_name` when that
    is a loopback address."""
    from torch.distributed import TCPStore

    if is_master and master_listen_fd is None and is_loopback(host_name):
        master_listen_fd, port = _bound_socket(host_name, port)
    return TCPStore(host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant,
                    master_listen_fd, use_libuv)


def worker_store(timeout: timedelta) -> dict:
    """`init_process_group` arguments (store, rank, world_size) for a loopback-only store on rank
    0, or {} to let torch build its own (a multi-node master address, or the agent's store)."""
    address, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not (address and port.isdigit() and is_loopback(address)) or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return {}
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = tcp_store(address, int(port), world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    return {"store": store, "rank": rank, "world_size": world_size}


def main() -> None:
    """torchrun, with the c10d rendezvous backend's store built by `tcp_store`."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.run import main as torchrun

    c10d_rendezvous_backend.TCPStore = tcp_store
    torchrun()


if __name__ == "__main__":
    sys.exit(main())
