"""torchft's HTTP checkpoint transport, advertised at the replica's own address.

A recovering replica fetches its state from a live peer at the URL the peer advertises. torchft's
``HTTPTransport`` advertises ``socket.gethostname()``, whatever ``hostname`` its Manager was given:
on nodes whose host name does not resolve, from the other nodes, to an address that reaches this one
(several interfaces, containers, the emulated cluster's namespaces), every heal fails with
"connection refused", including the first quorum's (``init_sync``). This transport serves the same
way and advertises the address the replica gives its Manager.

Imports torchft (``pip install lightning-strategies[ft]``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from torchft.checkpointing import HTTPTransport

__all__ = ["AdvertisedHTTPTransport"]


class AdvertisedHTTPTransport(HTTPTransport[Any]):
    """``HTTPTransport`` whose address names ``hostname`` instead of this machine's host name.

    Args:
        hostname: the name or address peers reach this process by (an IPv6 address is bracketed).
        timeout: a checkpoint transfer's timeout.
        num_chunks: torchft's chunking of the transfer (0: one stream).
    """

    def __init__(self, *, hostname: str, timeout: timedelta, num_chunks: int = 0) -> None:
        self.hostname = hostname  # first: torchft's constructor logs the address
        super().__init__(timeout=timeout, num_chunks=num_chunks)

    def address(self) -> str:
        """The URL torchft builds, with the host part replaced (port and path kept)."""
        url = urlsplit(super().address())
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        return urlunsplit(url._replace(netloc=f"{host}:{url.port}"))
