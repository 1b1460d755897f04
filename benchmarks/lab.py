"""The WAN lab: every peer of a swarm on its own network namespace, behind its own bandwidth cap.

On one Linux machine, the lab builds a small private network and runs processes on it:

    hub namespace  <tag>-hub            host namespaces <tag>-<name>
    +----------------------------+      +---------------------------------+
    | br0 (bridge)               |      | lo (up)                         |
    |   v0 <-- veth pair --------|------|-> eth0 10.213.<k>.1/24, tbf cap |
    |   v1 <-- veth pair --------|------|-> eth0 10.213.<k>.2/24, tbf cap |
    +----------------------------+      +---------------------------------+

The machine's own (root) namespace is never touched: the bridge and the hub-side veth ends live in
the hub namespace, the other ends (`eth0`) in each host's namespace. A host's cap (Mbit/s, `tc tbf`)
applies both ways: on its eth0 (upload) and on its veth end in the hub (download). There is no
added delay (this kernel has no netem): the lab models thin links, not long ones.

Names carry a tag made from the owning process id (`stlab<pid>`), so two labs never collide and the
leftovers of a lab whose process died (SIGKILL) are found and removed by `cleanup_stale()` or
`python benchmarks/lab.py cleanup`. A lab removes what it created on `close()`, on leaving its
`with` block, at interpreter exit, and on SIGINT/SIGTERM/SIGHUP while it is open.

Rehearse a run before lending it real machines (needs root)::

    sudo .venv/bin/python benchmarks/lab.py check
    sudo .venv/bin/python benchmarks/lab.py rehearse peer/demo.toml --servers 2 --trainers 1 --rate 100 --duration 90

A coordinator, the stage servers and the trainers start as `python -m peer.cli` processes, each in
its own namespace behind the cap; the lab prints the swarm's samples/s and each host's traffic every
few seconds, then a summary, and removes everything. `hold --hosts N` builds N hosts and waits, to
poke at by hand (`ip netns exec stlab<pid>-h0 bash`).

From Python: `with Lab() as lab: a = lab.add_host("a", rate_mbit=100)`, then `a.popen([...])` runs a
process on that host (`a.ip`), `a.counters()` gives its (tx, rx) bytes, `lab.set_rate(a, 10)` changes its cap.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TAG_PREFIX = "stlab"
STALE_RE = re.compile(rf"^{TAG_PREFIX}(\d+)\D")  # namespace names of labs: stlab<pid>..., the pid owns them
SUBNET = "10.213.{}.0/24"  # the lab's network; {} is the subnet index (labs are isolated, so any index works)
DEFAULT_SUBNET_INDEX = 0
CMD_TIMEOUT = 20.0  # s for one ip/tc command
TBF_LATENCY_MS = 50  # longest a packet may wait in the tbf queue: room for a few TCP windows
TBF_BURST_S = 0.005  # burst: 5 ms of traffic at the cap...
TBF_MIN_BURST = 32 * 1024  # ...but at least 32 KiB, so TCP segmentation offload packets pass whole
NOT_ROOT = "the WAN lab needs root: network namespaces and tc need CAP_NET_ADMIN; run it with sudo"
ROOT = Path(__file__).resolve().parent.parent


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


def open_benchmark(prog: str, figures: dict, nat: bool = False) -> None:
    """A lab benchmark's first step: unless the lab (and NAT hosts, if `nat`) can run here, say why and exit 2,
    with `skipped=lab_unavailable` among its `figures`; else remove what labs of SIGKILLed processes left."""
    try:
        check_available()
        if nat:
            _tool("iptables", "iptables (apt-get install iptables)")
    except LabError as e:
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        figures["skipped"] = "lab_unavailable"
        raise SystemExit(2) from None
    if removed := cleanup_stale():
        print(f"removed leftovers of dead labs: {', '.join(removed)}", flush=True)


# --- cleanup on signals and at exit: the only process-wide state, bookkeeping for open labs ---

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_open_labs: list[Lab] = []
_saved_handlers: dict[int, object] = {}
_handler_pid = [0]  # the process that installed the handlers (a forked child inherits them)
_atexit_registered = [False]


def _on_signal(signum: int, frame) -> None:
    if os.getpid() != _handler_pid[0]:  # a forked child: behave as if we were not here
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    previous = _saved_handlers.get(signum)
    if callable(previous):  # the program's own handler says how it stops (report.run's: KeyboardInterrupt)
        previous(signum, frame)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)  # finally-blocks and `with` exits run, and so does Lab.close


def _close_all() -> None:
    for lab in list(_open_labs):
        lab.close()


def _register(lab: Lab) -> None:
    if not _atexit_registered[0]:
        atexit.register(_close_all)
        _atexit_registered[0] = True
    if not _open_labs and threading.current_thread() is threading.main_thread():
        _handler_pid[0] = os.getpid()
        for sig in _SIGNALS:
            previous = signal.getsignal(sig)
            if previous is not signal.SIG_IGN:  # nohup and friends keep ignoring
                _saved_handlers[sig] = previous
                signal.signal(sig, _on_signal)
    _open_labs.append(lab)


def _unregister(lab: Lab) -> None:
    with contextlib.suppress(ValueError):
        _open_labs.remove(lab)
    if not _open_labs and threading.current_thread() is threading.main_thread():
        for sig, previous in list(_saved_handlers.items()):
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            del _saved_handlers[sig]


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT/SIGTERM/SIGHUP back while namespaces are being made or removed (delivered afterwards)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclass(eq=False)
class Host:
    """One machine of the lab: a network namespace whose eth0 has `ip` on the lab's bridge."""

    name: str
    netns: str
    ip: str
    rate_mbit: float | None
    hub_dev: str  # its veth end in the hub namespace (download cap)
    lab: Lab = field(repr=False)
    router: str = ""  # behind NAT: the namespace of its home router (whose public address is `public_ip`)
    public_ip: str = ""  # the address others see it come from (its router's, behind NAT; else `ip`)

    def _argv(self, argv: list[str]) -> list[str]:
        return [_tool("ip"), "netns", "exec", self.netns, *map(str, argv)]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start argv in this host's namespace, in its own session; the lab kills its process group on close.

        The process also dies with ours (PR_SET_PDEATHSIG, kept across `ip netns exec`): a lab whose owner was
        SIGKILLed leaves namespaces for `cleanup_stale`, but no peers still running in them.
        """
        from peer.lifetime import tied_to_me  # here: `python benchmarks/lab.py` puts the root on sys.path late

        if self.lab._closed:
            raise LabError(f"the lab of host {self.name} is closed")
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(tied_to_me(self._argv(argv)), **kwargs)
        self.lab._procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
        """Run argv in this host's namespace to completion (killed after `timeout` s)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.run(self._argv(argv), timeout=timeout, **kwargs)

    def counters(self) -> tuple[int, int]:
        """(tx_bytes, rx_bytes) of this host's eth0 so far."""
        out = _cmd(["ip", "-n", self.netns, "-s", "-j", "link", "show", "dev", "eth0"]).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


class Lab:
    """A private network of hosts (network namespaces) on one bridge; a context manager that removes it all.

    `subnet_index` k gives the hosts 10.213.k.1, .2, ...; `tag` prefixes every name (default `stlab<pid>`, or
    `stlab<pid>x2`... for a second lab of the process: the form `cleanup_stale` recognises once the pid is gone).
    """

    def __init__(self, subnet_index: int | None = None, tag: str | None = None):
        if os.geteuid() != 0:
            raise LabError(NOT_ROOT)
        self.subnet_index = DEFAULT_SUBNET_INDEX if subnet_index is None else subnet_index
        if not 0 <= self.subnet_index <= 255:
            raise ValueError(f"subnet_index must be 0..255, not {self.subnet_index}")
        self.tag = tag or self._free_tag()
        if not re.fullmatch(r"[A-Za-z0-9_.]{1,40}", self.tag):
            raise ValueError(f"lab tag {self.tag!r}: use letters, digits, '_' and '.'")
        self.subnet = SUBNET.format(self.subnet_index)
        self.hub = f"{self.tag}-hub"
        self.hosts: list[Host] = []
        self._procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []  # created by this lab, in creation order
        self._owner = os.getpid()
        self._closed = False
        _register(self)
        try:
            with _signals_deferred():
                self._add_netns(self.hub)
                _cmd(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
                _cmd(["ip", "-n", self.hub, "link", "set", "br0", "addrgenmode", "none", "up"])  # no IPv6 chatter
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_tag() -> str:
        base, taken = f"{TAG_PREFIX}{os.getpid()}", namespaces()
        for k in range(1, 1000):
            tag = base if k == 1 else f"{base}x{k}"
            if not any(ns.startswith(f"{tag}-") for ns in taken):
                return tag
        raise LabError(f"no free lab tag for {base}")

    def _add_netns(self, name: str) -> None:
        result = _cmd(["ip", "netns", "add", name], check=False)
        if result.returncode != 0:
            raise LabError(f"`ip netns add {name}` failed: {result.stderr.strip()}")
        self._namespaces.append(name)
        _cmd(["ip", "-n", name, "link", "set", "lo", "up"])  # the p2p daemon and gRPC use loopback too

    def _plug(self, netns: str, hub_dev: str, ip: str) -> None:
        """Give `netns` an eth0 with `ip` on the lab's bridge (its other end: `hub_dev` in the hub)."""
        veth = ["type", "veth", "peer", "name", "eth0", "netns", netns]
        _cmd(["ip", "-n", self.hub, "link", "add", hub_dev, *veth])
        _cmd(["ip", "-n", self.hub, "link", "set", hub_dev, "addrgenmode", "none", "master", "br0", "up"])
        _cmd(["ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0"])
        _cmd(["ip", "-n", netns, "link", "set", "eth0", "addrgenmode", "none", "up"])

    def add_host(self, name: str, rate_mbit: float | None = None) -> Host:
        """A new host `name` (namespace `<tag>-<name>`) on the bridge, capped at `rate_mbit` both ways (None: no cap)."""
        if self._closed:
            raise LabError("this lab is closed")
        if not re.fullmatch(r"[A-Za-z0-9_.]{1,40}", name) or any(h.name == name for h in self.hosts):
            raise ValueError(f"host name {name!r}: use a new name of letters, digits, '_' and '.'")
        index = len(self.hosts)
        if index >= 254:
            raise LabError("a lab has at most 254 hosts")
        ip = str(ipaddress.ip_network(self.subnet).network_address + index + 1)
        host = Host(name, f"{self.tag}-{name}", ip, None, f"v{index}", self)
        with _signals_deferred():
            self._add_netns(host.netns)
            self._plug(host.netns, host.hub_dev, host.ip)
        self.hosts.append(host)
        self.set_rate(host, rate_mbit)
        return host

    def add_nat_host(self, name: str, rate_mbit: float | None = None) -> Host:
        """A host behind a home router: it dials out (MASQUERADE), nobody can dial in.

        The router (namespace `<tag>-<name>-nat`) sits on the bridge with a lab address; the host's eth0
        has 10.214.<k>.2 on a private link to it, and no lab host has a route to that network. Needs iptables.
        """
        if self._closed:
            raise LabError("this lab is closed")
        if not re.fullmatch(r"[A-Za-z0-9_.]{1,36}", name) or any(h.name == name for h in self.hosts):
            raise ValueError(f"host name {name!r}: use a new name of letters, digits, '_' and '.'")
        index = len(self.hosts)
        if index >= 254:
            raise LabError("a lab has at most 254 hosts")
        public = str(ipaddress.ip_network(self.subnet).network_address + index + 1)
        host = Host(name, f"{self.tag}-{name}", f"10.214.{index}.2", None, f"v{index}", self)
        host.router, host.public_ip = f"{self.tag}-{name}-nat", public
        iptables = _tool("iptables", "iptables (apt-get install iptables)")
        with _signals_deferred():
            self._add_netns(host.router)
            self._add_netns(host.netns)
            self._plug(host.router, host.hub_dev, public)
            _cmd(
                [
                    "ip",
                    "-n",
                    host.router,
                    "link",
                    "add",
                    "lan0",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    host.netns,
                ]
            )
            _cmd(["ip", "-n", host.router, "addr", "add", f"10.214.{index}.1/24", "dev", "lan0"])
            _cmd(["ip", "-n", host.router, "link", "set", "lan0", "addrgenmode", "none", "up"])
            _cmd(["ip", "-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0"])
            _cmd(["ip", "-n", host.netns, "link", "set", "eth0", "addrgenmode", "none", "up"])
            _cmd(["ip", "-n", host.netns, "route", "add", "default", "via", f"10.214.{index}.1"])
            _cmd(["ip", "netns", "exec", host.router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
            masquerade = [
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-s",
                f"10.214.{index}.0/24",
                "-o",
                "eth0",
                "-j",
                "MASQUERADE",
            ]
            _cmd(["ip", "netns", "exec", host.router, iptables, *masquerade])
        self.hosts.append(host)
        self.set_rate(host, rate_mbit)
        return host

    def set_rate(self, host: Host, rate_mbit: float | None) -> None:
        """Cap `host` at `rate_mbit` Mbit/s up and down (None: remove the cap)."""
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate must be > 0 Mbit/s or None, not {rate_mbit}")
        for netns, dev in ((host.netns, "eth0"), (self.hub, host.hub_dev)):
            if rate_mbit is None:
                _cmd(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], check=False)
            else:
                _cmd(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *tbf_args(rate_mbit)])
        host.rate_mbit = rate_mbit

    def close(self, grace: float = 3.0, reaper_grace: float = REAPER_GRACE) -> None:
        """Stop every process of the lab (SIGTERM, `grace` s, SIGKILL), give what is left in its namespaces
        `reaper_grace` s to end, and delete them. Idempotent."""
        if self._closed or os.getpid() != self._owner:  # a forked child must not tear down its parent's lab
            return
        self._closed = True
        with _signals_deferred():
            try:
                self._stop_procs(grace)
                self._await_reapers(reaper_grace)
                for ns in reversed(self._namespaces):  # hosts first, the hub last
                    with contextlib.suppress(Exception):
                        _empty_netns(ns)
                        _cmd(["ip", "netns", "del", ns], check=False)
            finally:
                _unregister(self)

    def _await_reapers(self, grace: float) -> None:
        """Give the peers' reapers (peer.lifetime), left in the namespaces, `grace` s to end their peers'
        helpers and remove their files before what is still there gets SIGKILL."""
        deadline = time.monotonic() + grace
        while any(_netns_pids(ns) for ns in self._namespaces) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _stop_procs(self, grace: float) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in self._procs:
                if sig == signal.SIGKILL or proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, sig)
            deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
            for proc in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.01, deadline - time.monotonic()))

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- rehearse: a whole swarm in the lab ---


class Tail:
    """The JSON lines a peer writes to a growing file (a trainer's --log-file); `read()` gives all so far."""

    def __init__(self, path: Path):
        self.path, self.offset, self.entries = path, 0, []

    def read(self) -> list[dict]:
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
            end = data.rfind(b"\n") + 1  # leave a line being written for next time
            self.offset += end
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError):
                    self.entries.append(json.loads(line))
        return self.entries


def start_peer(host: Host, work: Path, args: list[str], settings: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start `python -m peer.cli args` on `host`, in its own directory with its own TMPDIR (p2p daemon sockets)."""
    home = work / host.name
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(home / "tmp"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    with open(home / "peer.log", "wb") as log:
        return host.popen(
            [sys.executable, "-m", "peer.cli", *args, *(f"--set={item}" for item in settings)],
            cwd=home,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _log(work: Path, host: Host) -> str:
    with contextlib.suppress(OSError):
        return (work / host.name / "peer.log").read_text(errors="replace")
    return ""


def join_args(maddr: str, host: Host) -> list[str]:
    """`peer join` arguments for a peer on `host`: its own key, the host's address, one torch thread."""
    return ["join", maddr, "--identity", f"{host.name}.pem", "--host", host.ip, "--threads", "1"]


def wait_for(what: str, ready, procs: dict[str, subprocess.Popen], work: Path, hosts: dict, timeout: float) -> None:
    """Poll `ready()`; LabError (with the log's tail) when one of `procs` exits first or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while not ready():
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise LabError(f"{name} exited early (status {proc.returncode}):\n{_log(work, hosts[name])[-3000:]}")
        if time.monotonic() > deadline:
            raise LabError(f"waited {timeout:.0f} s for {what}; logs in {work}")
        time.sleep(0.3)


def rehearse(
    spec_path: str,
    servers: int,
    trainers: int,
    rate_mbit: float | None,
    duration: float | None = None,
    workdir: str = "",
    overrides: tuple[str, ...] = (),
    peer_settings: tuple[str, ...] = (),
    interval: float = 5.0,
    console=None,
    start_timeout: float = 180.0,
) -> dict:
    """Run a coordinator, `servers` stage servers and `trainers` trainers, each on its own capped lab host.

    `overrides` (FIELD=VALUE) change the run spec, `peer_settings` every peer's settings (their `--set`).
    Prints progress every `interval` s and a summary; returns the summary (samples, samples_per_s, per-host bytes).
    `duration` bounds the training time (from the trainers' start; None: until they finish).
    """

    from rich.console import Console

    from peer.config import RunSpec, apply_override
    from peer.demo import spec_to_toml

    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    spec = RunSpec.from_toml(spec_path)
    for item in overrides:
        apply_override(spec, item)
    work = Path(workdir or tempfile.mkdtemp(prefix="swarmtrain-lab-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "run.toml").write_text(spec_to_toml(spec))
    cap = f"{rate_mbit:g} Mbit/s" if rate_mbit else "no cap"
    stages, t0 = spec.stages.num_stages, time.time()
    summary: dict = {"workdir": str(work), "samples": 0, "samples_per_s": 0.0, "hosts": {}}
    with Lab() as lab:
        roles = {"coordinator": "coordinator"}
        roles |= {
            f"server{i}": f"server (stage {i % stages})" if servers >= stages else "server" for i in range(servers)
        }
        roles |= {f"trainer{i}": "trainer" for i in range(trainers)}
        hosts = {name: lab.add_host(name, rate_mbit) for name in roles}
        console.print(
            f"[bold]WAN lab {lab.tag}[/bold]: {len(hosts)} hosts on {lab.subnet}, each capped at {cap} "
            f"both ways; logs in {work}"
        )
        procs: dict[str, subprocess.Popen] = {}
        tails: dict[str, Tail] = {}
        base, started, stopped = {}, time.time(), set()
        try:
            coord = hosts["coordinator"]
            info = work / "coordinator.json"
            argv = ["coordinator", str(work / "run.toml"), "--identity", "coordinator.pem", "--host", coord.ip]
            procs["coordinator"] = start_peer(coord, work, [*argv, "--info-file", str(info)], peer_settings)
            wait_for("the coordinator", info.exists, procs, work, hosts, start_timeout)
            maddr = json.loads(info.read_text())["join"].split()[-1]
            if f"/ip4/{coord.ip}/" not in maddr:
                raise LabError(f"the coordinator announces {maddr}, not its lab address {coord.ip}")
            console.print(f"coordinator up at {maddr}")
            names = [f"server{i}" for i in range(servers)]
            for i, name in enumerate(names):
                stage = ["--stage", str(i % stages)] if servers >= stages else []
                procs[name] = start_peer(hosts[name], work, [*join_args(maddr, hosts[name]), *stage], peer_settings)
            servers_up = lambda: all(re.search(r"Serving stage \d+ at ", _log(work, hosts[n])) for n in names)  # noqa: E731
            wait_for("the stage servers", servers_up, procs, work, hosts, start_timeout)
            base, started = {name: host.counters() for name, host in hosts.items()}, time.time()
            for i in range(trainers):
                name = f"trainer{i}"
                trainer = ["--role", "trainer", "--seed", str(i), "--log-file", "trainer.jsonl", "--max-inflight", "1"]
                procs[name] = start_peer(hosts[name], work, [*join_args(maddr, hosts[name]), *trainer], peer_settings)
                tails[name] = Tail(work / name / "trainer.jsonl")
            console.print(f"{servers} server(s) serving after {time.time() - t0:.0f} s; {trainers} trainer(s) started")
            _follow(console, hosts, procs, tails, started, duration, interval)
        except KeyboardInterrupt:
            console.print("interrupted; stopping the swarm (Ctrl+C again to kill it)")
            summary["interrupted"] = True
        finally:
            live = [n for n in sorted(procs, key=lambda n: not n.startswith("trainer")) if procs[n].poll() is None]
            for name in live:  # every peer leaves at once (trainers told first): Ctrl+C should not take long
                stopped.add(name)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(procs[name].pid, signal.SIGTERM)
            deadline = time.monotonic() + 6.0
            for name in live:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    procs[name].wait(max(0.01, deadline - time.monotonic()))
            if tails:
                summary.update(_summary(console, hosts, roles, base, tails, started, work, cap))
            lab.close(grace=0.5)  # what did not leave in time is killed now
        failed = [n for n in tails if n not in stopped and procs[n].returncode != 0]
        for name in failed:
            console.print(f"[red]{name} failed[/red]:\n{_log(work, hosts[name])[-2000:]}")
        summary["failed"] = failed
    console.print(f"lab {lab.tag} removed")
    return summary


def _follow(console, hosts, procs, tails, started, duration, interval) -> None:
    trainers = [p for n, p in procs.items() if n.startswith("trainer")]
    last, counts = time.time(), {name: host.counters() for name, host in hosts.items()}
    seen = dict.fromkeys(tails, 0)
    while any(p.poll() is None for p in trainers):
        if duration is not None and time.time() - started >= duration:
            console.print(f"{duration:g} s of training done")
            return
        time.sleep(min(interval, 0.5))
        now = time.time()
        if now - last < interval:
            continue
        samples = 0
        for name, tail in tails.items():
            new, seen[name] = tail.read()[seen[name] :], len(tail.entries)
            samples += sum(e["samples"] for e in new if e.get("type") == "micro_batch")
        fresh = {name: host.counters() for name, host in hosts.items()}
        traffic = " ".join(
            f"{name} {(fresh[name][0] - counts[name][0]) * 8e-6 / (now - last):.1f}/"
            f"{(fresh[name][1] - counts[name][1]) * 8e-6 / (now - last):.1f}"
            for name in hosts
        )
        console.print(f"{now - started:5.0f} s | {samples / (now - last):6.1f} samples/s | tx/rx Mbit/s: {traffic}")
        last, counts = now, fresh


def _summary(console, hosts, roles, base, tails, started, work, cap) -> dict:
    from rich.table import Table

    batches = [e for tail in tails.values() for e in tail.read() if e.get("type") == "micro_batch"]
    samples = sum(e["samples"] for e in batches)
    elapsed = max((e["time"] for e in batches), default=time.time()) - started
    table = Table(
        title=f"WAN lab rehearsal: {samples} samples in {elapsed:.0f} s of training, "
        f"{samples / max(elapsed, 1e-9):.1f} samples/s, every host capped at {cap}"
    )
    for col in ("host", "role", "address", "tx MB", "rx MB", "tx Mbit/s", "rx Mbit/s"):
        table.add_column(col, justify="left" if col in ("host", "role", "address") else "right")
    result = dict(workdir=str(work), samples=samples, seconds=elapsed, samples_per_s=samples / max(elapsed, 1e-9))
    result["hosts"] = {}
    for name, host in hosts.items():
        tx, rx = (now - then for now, then in zip(host.counters(), base[name], strict=True))
        result["hosts"][name] = {"ip": host.ip, "tx_bytes": tx, "rx_bytes": rx}
        rate = 8e-6 / max(elapsed, 1e-9)
        table.add_row(
            name, roles[name], host.ip, f"{tx / 1e6:.1f}", f"{rx / 1e6:.1f}", f"{tx * rate:.1f}", f"{rx * rate:.1f}"
        )
    console.print(table)
    return result


# --- command line ---


def _hold(hosts: int, rate_mbit: float | None) -> int:
    with Lab() as lab:
        for i in range(hosts):
            lab.add_host(f"h{i}", rate_mbit)
        cap = f"{rate_mbit:g} Mbit/s" if rate_mbit else "no cap"
        print(f"lab {lab.tag}: hub namespace {lab.hub} (bridge br0), subnet {lab.subnet}, each host capped at {cap}")
        for host in lab.hosts:
            print(f"  {host.netns:<28} {host.ip}")
        print("holding; Ctrl+C (or SIGTERM) removes everything", flush=True)
        while True:
            time.sleep(3600)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lab.py",
        description="The WAN lab: run each peer of a swarm in its own network namespace behind a bandwidth cap "
        "(tc tbf). Needs root; removes everything it creates, also on Ctrl+C.",
        epilog="examples:\n  sudo .venv/bin/python benchmarks/lab.py check\n"
        "  sudo .venv/bin/python benchmarks/lab.py rehearse peer/demo.toml --servers 2 --trainers 1 --rate 100\n"
        "  sudo .venv/bin/python benchmarks/lab.py hold --hosts 3 --rate 20   # then: ip netns exec stlab<pid>-h0 bash\n"
        "First calls' deadlines allow their bytes to cross a link of trainer.min_link_mbit (10 Mbit/s);\n"
        "to rehearse thinner links, lower it too, e.g. --rate 5 --peer-set trainer.min_link_mbit=5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="say whether the lab can run here, and why not (exit 2 when it cannot)")
    sub.add_parser("cleanup", help="remove the namespaces of labs whose process died")
    p = sub.add_parser("rehearse", help="rehearse a run: coordinator, N servers, M trainers, each on a capped host")
    p.add_argument("spec", help="the run spec (TOML), e.g. peer/demo.toml")
    p.add_argument("--servers", type=int, default=2, help="stage servers (>= the spec's stages: pinned round-robin)")
    p.add_argument("--trainers", type=int, default=1, help="trainers")
    p.add_argument("--rate", type=float, default=None, help="every host's cap in Mbit/s, up and down (default: none)")
    p.add_argument("--duration", type=float, default=None, help="seconds of training (default: until trainers end)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--workdir", default="", help="keep logs here (default: a temporary directory)")
    example = "override a run spec field, e.g. --set training.total_steps=50 (VALUE in TOML syntax)"
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help=example)
    example = "a peer setting passed to every peer's `--set`, e.g. --peer-set trainer.min_link_mbit=5"
    p.add_argument("--peer-set", action="append", default=[], metavar="FIELD=VALUE", help=example)
    p = sub.add_parser("hold", help="create N hosts, print them and wait until Ctrl+C or SIGTERM")
    p.add_argument("--hosts", type=int, default=2, help="how many hosts")
    p.add_argument("--rate", type=float, default=None, help="each host's cap in Mbit/s (default: none)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_available()
    except LabError as e:
        print(f"lab.py {args.command}: {e}", file=sys.stderr)
        return 2
    if args.command == "check":
        print("the WAN lab can run here: root, iproute2, network namespaces, veth, bridges and tbf all work")
        return 0
    try:
        removed = cleanup_stale()
        if removed or args.command == "cleanup":
            print(f"removed leftovers of dead labs: {', '.join(removed) or 'none'}", flush=True)
        if args.command == "hold":
            return _hold(args.hosts, args.rate)
        if args.command == "rehearse":
            if args.servers < 1 or args.trainers < 1:
                raise ValueError("need at least one server and one trainer")
            run = dict(duration=args.duration, workdir=args.workdir, overrides=tuple(args.set), interval=args.interval)
            run["peer_settings"] = tuple(args.peer_set)
            summary = rehearse(args.spec, args.servers, args.trainers, args.rate, **run)
            return 130 if summary.get("interrupted") else 1 if summary["failed"] else 0
        return 0
    except KeyboardInterrupt:
        print("interrupted; the lab is removed", file=sys.stderr, flush=True)
        return 130
    except (LabError, ValueError, OSError) as e:  # a peer that failed, a bad spec or flag: one line, no traceback
        print(f"lab.py {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # `python benchmarks/lab.py` puts benchmarks/ first; peer lives at the root
    sys.exit(main())
