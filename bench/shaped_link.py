"""A network link of a chosen bandwidth between the ranks of one machine, for the benches (`--link-rate 10gbit`).

On one machine gloo's ranks talk over the loopback device, at memory speed: communication there costs CPU, not
bandwidth, so settings that send fewer bytes (a 16-bit wire, ZeRO++'s int8 gathers and reductions) save little. A
real cluster's ranks talk over a link of 10-400 Gbit/s. `shaped_link(rate, ranks)` gives each rank an address of its
own on a virtual device (a veth pair: `flexlink<rank>`, 10.88.0.<rank + 1>; traffic between two addresses of one
machine still goes through the loopback device) and limits what is sent *to* that address with a token bucket on the
loopback device (Linux `tc`: an `htb` root with a class per rank, u32 filters on the destination). Each rank's
inbound traffic gets `rate`, so every direction of every pair is limited as on a full-duplex link of that rate, and
the rest of the machine's loopback traffic is untouched. A rank selects its address with
`GLOO_SOCKET_IFNAME=flexlink<rank>` before `init_process_group('gloo')`: `env_for(rank)`.

Needs root (CAP_NET_ADMIN) and the `ip` and `tc` commands; everything made is removed on exit, also after an error.
"""
import contextlib, shutil, subprocess

PREFIX, NET = 'flexlink', '10.88.0.'


def address(rank: int) -> str:
    return f"{NET}{rank + 1}"


def env_for(rank: int) -> dict:
    "What rank `rank`'s environment needs so that gloo sends and receives on its shaped address"
    return {'GLOO_SOCKET_IFNAME': f"{PREFIX}{rank}"}


def _run(*cmd, check=True):
    got = subprocess.run(cmd, capture_output=True, text=True)
    if check and got.returncode:
        raise SystemExit(f"--link-rate: `{' '.join(cmd)}` failed: {got.stderr.strip() or got.stdout.strip()} "
                         "(a shaped link needs root with CAP_NET_ADMIN, and no other qdisc on the loopback device)")
    return got


def _clear(ranks: int):
    "Remove what `shaped_link` made (quietly: some of it may not exist)"
    _run('tc', 'qdisc', 'del', 'dev', 'lo', 'root', check=False)
    for r in range(ranks): _run('ip', 'link', 'del', f"{PREFIX}{r}", check=False)  # its peer goes with it


@contextlib.contextmanager
def shaped_link(rate: str, ranks: int, burst: str = '512kb'):
    "Within the block, traffic to each rank's address goes through its own token bucket of `rate` (tc's units)"
    missing = [c for c in ('ip', 'tc') if shutil.which(c) is None]
    if missing: raise SystemExit(f"--link-rate needs the {' and '.join(missing)} command(s) (iproute2)")
    held = _run('tc', 'qdisc', 'show', 'dev', 'lo').stdout
    if 'noqueue' not in held and held.strip():
        raise SystemExit(f"--link-rate: the loopback device already has a qdisc ({held.strip()}); remove it first "
                         "(tc qdisc del dev lo root) or run without --link-rate")
    try:
        for r in range(ranks):
            _run('ip', 'link', 'add', f"{PREFIX}{r}", 'type', 'veth', 'peer', 'name', f"{PREFIX}peer{r}")
            _run('ip', 'addr', 'add', f"{address(r)}/32", 'dev', f"{PREFIX}{r}")
            _run('ip', 'link', 'set', f"{PREFIX}{r}", 'up')
            _run('ip', 'link', 'set', f"{PREFIX}peer{r}", 'up')
        # an HTB root: a class of `rate` per rank, u32 filters on the destination; unmatched traffic (default 0)
        # leaves unshaped, as before
        _run('tc', 'qdisc', 'add', 'dev', 'lo', 'root', 'handle', '1:', 'htb', 'default', '0')
        for r in range(ranks):
            band = f"1:{10 + r}"
            _run('tc', 'class', 'add', 'dev', 'lo', 'parent', '1:', 'classid', band, 'htb', 'rate', rate, 'ceil', rate,
                 'burst', burst, 'cburst', burst, 'quantum', '200000')
            _run('tc', 'filter', 'add', 'dev', 'lo', 'parent', '1:', 'protocol', 'ip', 'prio', '1', 'u32',
                 'match', 'ip', 'dst', f"{address(r)}/32", 'flowid', band)
        yield [env_for(r) for r in range(ranks)]
    finally:
        _clear(ranks)
