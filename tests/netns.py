"""Two real hosts on one machine, for multi-node tests: Linux network namespaces joined by a veth pair.

``two_hosts()`` makes namespaces with one end of a veth pair each, at 10.200.0.1/24 and 10.200.0.2/24 (only
these addresses: nothing else is routed, so no traffic leaves the pair), and gives each host its own hostname
(a UTS namespace per process) that the other resolves through ``/etc/netns/NS/hosts``, which ``ip netns exec``
mounts over ``/etc/hosts``. That is what torchrun's c10d rendezvous needs to tell hosts apart: it finds the
rendezvous host by comparing the endpoint with this machine's name and addresses, and each node announces
``socket.getfqdn()`` as its address. Everything is removed on leaving the context, also after a failure, and
processes the hosts started are SIGKILLed first (only those, by their ids).

Needs root and iproute2 (``ip netns``); ``unavailable()`` says why not, for a clean skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from shardtune.dist import children

ADDRESSES = ("10.200.0.1", "10.200.0.2")
PREFIX_LEN = 24
ETC_NETNS = Path("/etc/netns")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why two namespace hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (iproute2 / util-linux)"
    probe = f"stprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"'ip netns add' fails here: {getattr(exc, 'stderr', '') or exc}".strip()
    _ip("netns", "del", probe)
    return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class Host:
    """One namespace host: its hostname, address and interface, and the processes started on it."""

    hostname: str
    netns: str
    iface: str
    addr: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host: its network namespace and its own hostname."""
        set_name = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--", "sh", "-c", set_name, self.hostname,
                *argv]

    def start(self, argv: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start ``argv`` on this host, output to ``log``; the process is ``argv`` itself (each wrapper execs)."""
        env = {**env, "GLOO_SOCKET_IFNAME": self.iface}  # gloo binds the veth, not whatever the name resolves to
        with log.open("w") as out:
            proc = subprocess.Popen(self.command(argv), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL ``proc`` and its children at once, as a host that loses power takes them all."""
        for pid in [*children(proc.pid), proc.pid]:
            _kill(pid)
        proc.wait(timeout=30)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc)


@contextmanager
def two_hosts(tag: str = "") -> Iterator[tuple[Host, Host]]:
    """Two hosts joined by a veth pair at ``ADDRESSES``; removed on exit, with every process they started."""
    tag = tag or str(os.getpid())
    hosts = tuple(Host(hostname=f"sthost{i}-{tag}", netns=f"stns{i}-{tag}", iface=f"stv{i}-{tag}"[:15],
                       addr=ADDRESSES[i]) for i in range(2))
    hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.hostname}\n" for h in hosts)
    made: list[Host] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.netns)
            made.append(host)
            (ETC_NETNS / host.netns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / host.netns / "hosts").write_text(hosts_file)
            # No name server: a lookup the hosts file cannot answer fails at once instead of timing out.
            (ETC_NETNS / host.netns / "resolv.conf").write_text("# no DNS for test hosts\n")
        a, b = hosts
        _ip("link", "add", a.iface, "type", "veth", "peer", "name", b.iface)
        for host in hosts:
            _ip("link", "set", host.iface, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/{PREFIX_LEN}", "dev", host.iface)
            _ip("-n", host.netns, "link", "set", host.iface, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for host in hosts:
            host.kill_all()
        # A pair still in this namespace (moving it failed) would outlive the namespaces: delete it by name.
        subprocess.run(["ip", "link", "del", hosts[0].iface], capture_output=True, timeout=30)
        for host in made:  # deleting a namespace deletes the veth end in it, and so the pair
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=30)
            shutil.rmtree(ETC_NETNS / host.netns, ignore_errors=True)
