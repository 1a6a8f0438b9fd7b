"""Acting on a lost peer: make this process's blocked and later communication fail at once.

Standalone on purpose (the standard library and ``torch.distributed`` at run time): a test runs it in a
fresh interpreter without the package, which imports Lightning.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_strategies.comm.peer_lost import PeerDiagnosis

__all__ = ["abort_communication", "add_abort_group", "add_abort_hook"]

log = logging.getLogger(__name__)


# What abort_communication also runs: waits that are local, not on a connection (a parameter-server
# shard's barrier waiting for a frozen worker's push), registered by the modules that own them.
_ABORT_HOOKS: list[Callable[[PeerDiagnosis | None], object]] = []


# The process groups besides the default one that abort_communication aborts, in the order they were added
# (torch has no public list of a process's groups): weak, so a destroyed group's connections close as before.
_GROUPS: list[weakref.ref[dist.ProcessGroup]] = []


def add_abort_group(group: dist.ProcessGroup) -> None:
    """Have :func:`abort_communication` abort ``group`` too while it lives (the default group always is).

    :func:`lightning_strategies.comm.groups.new_group` adds every group this package makes.
    """
    _GROUPS[:] = [ref for ref in _GROUPS if ref() is not None]
    if all(ref() is not group for ref in _GROUPS):
        _GROUPS.append(weakref.ref(group))


def add_abort_hook(hook: Callable[[PeerDiagnosis | None], object]) -> Callable[[], None]:
    """Have :func:`abort_communication` also call ``hook(diagnosis)``; returns a remover."""
    _ABORT_HOOKS.append(hook)
    return lambda: _ABORT_HOOKS.remove(hook) if hook in _ABORT_HOOKS else None


def abort_communication(diagnosis: PeerDiagnosis | None = None) -> list[str]:
    """Make this process's blocked and later communication fail at once, because a peer is gone.

    NCCL groups are aborted, subgroups first: the default group and those added by :func:`add_abort_group`
    (every group this package makes; torch lists a process's groups only in its private state). Where gloo
    runs (and TensorPipe's RPC), whose ``abort()`` does not unblock a pending operation, this process's
    connected TCP sockets are shut down both ways (Linux ``/proc``), except the store's and those inherited at
    a fork, so blocked operations fail as if the peer had died. Then every :func:`add_abort_hook` hook runs
    (waits no connection ends).

    Args:
        diagnosis: why (for the log); its store's connections are kept (without one: ``MASTER_PORT``'s).

    Returns:
        What was aborted, one line each.
    """
    done: list[str] = []
    groups = _process_groups()
    backends = {group: str(dist.get_backend(group)) for group in groups}
    for group in [g for g in reversed(groups) if "nccl" in backends[g]]:
        try:
            group.abort()
            done.append(f"NCCL process group {getattr(group, 'group_name', '?')} aborted")
        except Exception as err:
            log.warning(f"could not abort an NCCL process group: {err}")
    if any("gloo" in b for b in backends.values()):
        port = _store_port(diagnosis)
        count = _shutdown_tcp_connections(set() if port is None else {port})
        done.append(f"{count} TCP connection(s) shut down (the store's kept)")
    for hook in list(_ABORT_HOOKS):
        try:
            hook(diagnosis)
            done.append(f"{getattr(hook, '__qualname__', hook)} called")
        except Exception as err:
            log.warning(f"abort hook {hook} failed: {err}")
    return done


def _process_groups() -> list[dist.ProcessGroup]:
    """The default group, then every group added by :func:`add_abort_group` that is still initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return []
    groups = [dist.group.WORLD]
    for ref in _GROUPS:
        group = ref()
        if group is not None and group not in groups and _initialised(group):
            groups.append(group)
    return [g for g in groups if isinstance(g, dist.ProcessGroup)]


def _initialised(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_backend(group)  # raises ValueError for a destroyed group
    except (ValueError, RuntimeError):
        return False
    return True


def _store_port(diagnosis: PeerDiagnosis | None) -> int | None:
    """The store's port: the diagnosis's (its heartbeat's store), else ``MASTER_PORT`` (``env://``'s)."""
    port = diagnosis.store_host.rpartition(":")[2] if diagnosis is not None else ""
    port = port or os.environ.get("MASTER_PORT", "")
    return int(port) if port.isdigit() else None


def _sockets_of(pid: int | str) -> dict[str, str]:
    """``{fd: "socket:[inode]"}`` for the sockets of process ``pid`` ({} where /proc does not tell)."""
    fds = f"/proc/{pid}/fd"
    out = {}
    try:
        names = os.listdir(fds)
    except OSError:
        return {}
    for name in names:
        try:
            target = os.readlink(f"{fds}/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:"):
            out[name] = target
    return out


def _shutdown_tcp_connections(keep_ports: set[int]) -> int:
    """Shut down this process's connected TCP sockets but those on ``keep_ports`` and those inherited from
    the parent at a fork (a notebook kernel's: not ours to end); return how many."""
    if not os.path.isdir("/proc/self/fd"):
        log.warning("cannot shut down the TCP connections: no /proc/self/fd (not Linux)")
        return 0
    inherited = set(_sockets_of(os.getppid()).values()) if os.getppid() > 1 else set()
    count = 0
    for name, target in _sockets_of("self").items():
        if target in inherited:
            continue
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # closed meanwhile, or not a socket we can wrap
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            peer = sock.getpeername()  # OSError for a listening socket: nothing to shut down
            if sock.getsockname()[1] in keep_ports or peer[1] in keep_ports:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            continue
        finally:
            sock.close()
    return count
