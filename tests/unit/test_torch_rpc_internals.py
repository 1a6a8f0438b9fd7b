"""The torch RPC internals of ``comm/elastic.py:remove_from_torch_rpc_group`` (the only function
that touches them): each test fails when a torch release changes what it relies on."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import torch.distributed.rpc as rpc
from torch.distributed.rpc import _utils


def test_the_membership_functions_torch_uses_are_where_the_eviction_expects_them() -> None:
    params = list(inspect.signature(_utils._update_group_membership).parameters)
    assert params == ["worker_info", "my_devices", "reverse_device_map", "is_join"]
    source = inspect.getsource(_utils._group_membership_management)
    assert 'token_key = "RpcGroupManagementToken"' in source
    assert 'my_token = f"Token_for_{name}_{join_or_leave}"' in source
    assert 'store.set(my_token, "Done")' in source
    # a process's first init_rpc names the group's namespace rpc_prefix_0
    assert 'f"rpc_prefix_{_init_counter}"' in inspect.getsource(rpc.init_rpc)


_CHILD = textwrap.dedent(
    """
    from datetime import timedelta
    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    from lightning_strategies.comm.elastic import init_member_rpc, remove_from_torch_rpc_group

    base = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    def connect():
        return dist.PrefixStore("run", dist.TCPStore("127.0.0.1", base.port, is_master=False))
    name = init_member_rpc(connect(), connect, 0, 0, 2, timeout=timedelta(seconds=60))
    group = dist.PrefixStore("rpc_prefix_0", dist.PrefixStore("rpc", connect()))
    names = dist.PrefixStore("names", group)
    listed = names.get("_ALL_WORKER_INFOS").decode()
    assert listed == f"{name}-0,", listed
    names.set("_ALL_WORKER_INFOS", listed + "ghost-7,")  # a failed join's entry, and its token
    group.set("RpcGroupManagementToken", "Token_for_ghost_join")
    remove_from_torch_rpc_group(dist.PrefixStore("rpc", connect()), "ghost", 7, me=None)
    assert names.get("_ALL_WORKER_INFOS").decode() == f"{name}-0,"
    assert group.get("RpcGroupManagementToken").decode() == "" and group.get("Token_for_ghost_join") == b"Done"
    rpc.shutdown(graceful=False)
    print("ok")
    """
)


def test_the_group_list_and_token_are_where_the_eviction_edits_them() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
