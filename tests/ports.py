"""Ports for the tests' multi-process jobs: bound by the OS in the test's own process and held while the job runs.

A port found free and then released can be bound by another process before the job binds it. So the test binds
a TCPStore server to port 0 (the OS chooses the port at bind time) and keeps it while the job runs, and the job
joins that store as a client: ranks through torch's agent-store mode (as torchrun's workers join their agent's
store), torchrun's c10d rendezvous because it finds the endpoint's port taken and then connects to it.
"""

from __future__ import annotations

# The environment that makes env:// process groups join the store at MASTER_PORT instead of serving one on rank 0.
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1"}


def held_stores(count: int) -> list:
    """``count`` TCPStore servers on 127.0.0.1, on ports the OS chose when binding them, open until the caller
    drops them: give a job ``store.port`` (with ``AGENT_STORE_ENV`` for a process group)."""
    from torch.distributed import TCPStore

    return [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(count)]
