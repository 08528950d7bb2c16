"""Test hosts with their own addresses on one machine: network namespaces joined by a veth pair
(root and iproute2 needed; tests skip with the reason otherwise).

    with two_hosts("train") as hosts:     # [(namespace, address, interface), ...]
        subprocess.Popen(["ip", "netns", "exec", hosts[1][0], ...])
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator

SUBNET = "10.231.7"  # the tests' own hosts: .1 (node 0) and .2 (node 1), inside namespaces only
_serial = itertools.count()


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) and util-linux (unshare) are needed"
    probe = f"actx-probe-{os.getpid()}"
    try:
        ip("netns", "add", probe)
        ip("netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as err:
        return f"cannot create network namespaces here: {err}"
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    tag = f"{os.getpid() % 10000}{next(_serial)}"
    nodes = [(f"actx{tag}n{i}", f"{SUBNET}.{i + 1}", f"ax{tag}v{i}") for i in range(2)]
    for ns, _, _ in nodes:
        ip("netns", "add", ns)
    try:
        ip("link", "add", nodes[0][2], "type", "veth", "peer", "name", nodes[1][2])
        for ns, addr, dev in nodes:
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for ns, _, _ in nodes:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (launchers start children in new sessions)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
