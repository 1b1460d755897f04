"""The WAN lab's network tools (benchmarks/lab.py): ip and tc commands with deadlines, whether the lab can
run here, tbf settings, the lab's namespaces, and the removal of dead labs' leftovers."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import time

TAG_PREFIX = "stlab"


STALE_RE = re.compile(rf"^{TAG_PREFIX}(\d+)\D")  # namespace names of labs: stlab<pid>..., the pid owns them


SUBNET = "10.213.{}.0/24"  # the lab's network; {} is the subnet index (labs are isolated, so any index works)


DEFAULT_SUBNET_INDEX = 0


CMD_TIMEOUT = 20.0  # s for one ip/tc command


TBF_LATENCY_MS = 50  # longest a packet may wait in the tbf queue: room for a few TCP windows


TBF_BURST_S = 0.005  # burst: 5 ms of traffic at the cap...


# ...but at least 128 KiB, so TCP's segmentation offload packets (up to 64 KiB each) pass whole: a bucket
# smaller than one makes tbf cut it into MTU frames, which reach the receiver's TCP one at a time (a real NIC
# merges them back, GRO/LRO; veth does not). With 32 KiB, at 100 Mbit/s, that cost the lab's swarm 15-30 % more
# CPU per sample than uncapped, on the cores it computes with (benchmarks/wan.py's cpu_<codec>_<width>)
TBF_MIN_BURST = 128 * 1024


NOT_ROOT = "the WAN lab needs root: network namespaces and tc need CAP_NET_ADMIN; run it with sudo"


class LabError(RuntimeError):
    """The lab cannot run here (or an ip/tc command failed); the message says why and what to do."""


@functools.cache
def _tool(name: str, package: str = "iproute2 (apt-get install iproute2)") -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if not path:
        raise LabError(f"`{name}` not found: install {package}")
    return path


def _cmd(argv: list[str], check: bool = True, timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess:
    """Run an ip/tc command; LabError (with its stderr) when it fails and `check`."""
    argv = [_tool(argv[0]), *argv[1:]]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise LabError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from e
    if check and result.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.returncode}")
    return result


def check_available() -> None:
    """Raise LabError unless this process can build a lab: root, ip and tc, namespaces, veth, bridge, tbf."""
    if os.geteuid() != 0:
        raise LabError(NOT_ROOT)
    _tool("ip"), _tool("tc")
    probe = f"{TAG_PREFIX}{os.getpid()}p-probe"
    try:
        result = _cmd(["ip", "netns", "add", probe], check=False)
        if result.returncode != 0:
            raise LabError(
                f"cannot create network namespaces here (`ip netns add` said: {result.stderr.strip()}); "
                "in a container, run it with --privileged (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
            )
        steps = [
            (["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"], "veth pairs (veth)"),
            (["ip", "-n", probe, "link", "add", "pbr", "type", "bridge"], "bridges (bridge)"),
            (["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", *tbf_args(10)], "the tbf qdisc (sch_tbf)"),
        ]
        for argv, what in steps:
            result = _cmd(argv, check=False)
            if result.returncode != 0:
                raise LabError(f"this kernel lacks {what}: `{' '.join(argv)}` said {result.stderr.strip()}")
    finally:
        with contextlib.suppress(LabError):
            _cmd(["ip", "netns", "del", probe], check=False)


def tbf_args(rate_mbit: float) -> list[str]:
    """`tc qdisc ... root` arguments of a token bucket capping a link at `rate_mbit` Mbit/s."""
    burst = max(int(rate_mbit * 1e6 / 8 * TBF_BURST_S), TBF_MIN_BURST)
    return ["tbf", "rate", f"{round(rate_mbit * 1000)}kbit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]


def nat_available() -> str:
    """Why NAT hosts (Lab.add_nat_host) cannot be made here, or "" when they can."""
    try:
        check_available()
        _tool("iptables", "iptables (apt-get install iptables)")
    except LabError as e:
        return str(e)
    return ""


def namespaces() -> list[str]:
    """Every named network namespace on this machine (`ip netns list`)."""
    out = _cmd(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


REAPER_GRACE = 6.0  # s for the processes left in a closing lab's namespaces (the peers' reapers) to end


def _netns_pids(netns: str) -> list[int]:
    result = _cmd(["ip", "netns", "pids", netns], check=False, timeout=5.0)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def _empty_netns(netns: str, timeout: float = 3.0) -> None:
    """SIGKILL every process left in `netns` until none is."""
    deadline = time.monotonic() + timeout
    while (pids := _netns_pids(netns)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def cleanup_stale() -> list[str]:
    """Remove the namespaces (and processes in them) of labs whose owning process is gone; their names."""
    if os.geteuid() != 0:
        raise LabError(NOT_ROOT)
    stale = [ns for ns in namespaces() if (m := STALE_RE.match(ns)) and not _alive(int(m.group(1)))]
    stale.sort(key=lambda ns: ns.endswith("-hub"))  # hosts before their hub
    removed = []
    for ns in stale:
        _empty_netns(ns)
        if _cmd(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    return removed
