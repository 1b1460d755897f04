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
    sudo .venv/bin/python benchmarks/lab.py rehearse peer/cli/demo.toml --servers 2 --trainers 1 --rate 100 --duration 90

A coordinator, the stage servers and the trainers start as `python -m peer.cli.main` processes, each in
its own namespace behind the cap; the lab prints the swarm's samples/s and each host's traffic every
few seconds, then a summary, and removes everything. `hold --hosts N` builds N hosts and waits, to
poke at by hand (`ip netns exec stlab<pid>-h0 bash`).

From Python: `with Lab() as lab: a = lab.add_host("a", rate_mbit=100)`, then `a.popen([...])` runs a
process on that host (`a.ip`), `a.counters()` gives its (tx, rx) bytes, `lab.set_rate(a, 10)` changes its cap."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/lab.py` puts benchmarks/ first; the packages live at the root
    sys.path.insert(0, str(ROOT))

from benchmarks import netns as _netns_module  # noqa: E402
from benchmarks.netns import (  # noqa: E402
    DEFAULT_SUBNET_INDEX,
    NOT_ROOT,
    REAPER_GRACE,
    SUBNET,
    TAG_PREFIX,
    LabError,
    _cmd,
    _empty_netns,
    _netns_pids,
    _tool,
    check_available,
    cleanup_stale,
    namespaces,
    tbf_args,
)

# the lab's users (tests, benchmarks) find these here too
STALE_RE, nat_available, _alive = _netns_module.STALE_RE, _netns_module.nat_available, _netns_module._alive


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
        from peer.process.lifetime import tied_to_me  # here: `python benchmarks/lab.py` puts the root on sys.path late

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
        """Give the peers' reapers (peer.process.lifetime), left in the namespaces, `grace` s to end their peers'
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
        "  sudo .venv/bin/python benchmarks/lab.py rehearse peer/cli/demo.toml --servers 2 --trainers 1 --rate 100\n"
        "  sudo .venv/bin/python benchmarks/lab.py hold --hosts 3 --rate 20   # then: ip netns exec stlab<pid>-h0 bash\n"
        "First calls' deadlines allow their bytes to cross a link of trainer.min_link_mbit (10 Mbit/s);\n"
        "to rehearse thinner links, lower it too, e.g. --rate 5 --peer-set trainer.min_link_mbit=5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="say whether the lab can run here, and why not (exit 2 when it cannot)")
    sub.add_parser("cleanup", help="remove the namespaces of labs whose process died")
    p = sub.add_parser("rehearse", help="rehearse a run: coordinator, N servers, M trainers, each on a capped host")
    p.add_argument("spec", help="the run spec (TOML), e.g. peer/cli/demo.toml")
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
            from benchmarks.rehearsal import rehearse  # lazy: rehearsal builds on this module

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
    from benchmarks.lab import main as lab_main  # the module itself, not this __main__ copy: one registry of labs

    sys.exit(lab_main())
