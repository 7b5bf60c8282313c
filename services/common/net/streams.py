"""Refusing a client stream (a stream-unary RPC such as Buffer.PushTrajectories) so that the client
hears the status.

A status sent while the client is still writing closes the stream under the client's next write,
which grpc.aio reports as INTERNAL ("Failed execute_batch" / "Internal error from Core"), and, when the
status arrived while that write was in flight, records over the real status: the client would never
see the refusal. So before refusing, the server reads and drops what the client still sends, up to
its half-close (`read_to_half_close`). Only client streams wait: their clients expect nothing back
before they half-close, while the client of a bidirectional stream (EnvSession) waits for replies and
must hear of a refusal at once. Used by grpcutil's parsing (INVALID_ARGUMENT) and auth's role check
(PERMISSION_DENIED).
"""

from __future__ import annotations

from typing import Any

import grpc

# After refusing a client stream, at most this many more frames are read (and dropped) while waiting
# for the client to half-close; a client that sends more than that gets the status at once. More than
# an actor's Pusher writes to one stream by default.
DRAIN_LIMIT_FRAMES = 65536


async def read_to_half_close(context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """Read and drop the client's frames until it half-closes, at most DRAIN_LIMIT_FRAMES of them."""
    for _ in range(DRAIN_LIMIT_FRAMES):
        if await context.read() is grpc.aio.EOF:
            return
