"""How a one-node launcher hands the run's store socket to rank 0 (stdlib only: the launcher,
:mod:`runner.local_ranks`, imports this without torch; ``engine.distributed`` reads it).

The launcher binds and listens on a loopback port, passes the socket's descriptor to rank 0 (and
only rank 0) under :data:`STORE_FD_VARIABLE` (the others get it empty), and gives every rank the
port as ``MASTER_PORT``: rank 0 serves torch's TCPStore on that socket, the others connect to it,
each building its store itself (``init_process_group`` prefixes the keys of a store it builds
from ``env://`` and not those of one it is given, so all ranks of a world must do the same). Nothing can take the
port between its choice and its use.
"""

STORE_FD_VARIABLE = "TRAINWRIGHT_STORE_FD"
