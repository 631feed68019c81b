"""The kernel's record hub against idle, hostile and broken connections: it serves many ranks at once, closes what
does not authenticate in time, carries data only (a pickle is never unpickled), refuses oversized messages, and drops
and counts malformed ones while the connection's later records still arrive. Every wait is on an event the hub
causes (a closed socket, a flush reply), never on the clock."""
import json, os, pickle, socket, warnings
import pytest
from flexrt import monitor
from flexrt.monitor import wire

@pytest.fixture(autouse=True)
def clean():
    yield
    for fn in monitor.events._listeners: monitor.remove_listener(fn)
    monitor.stop_serving()

def _address(hub): host, port = hub.address.rsplit(':', 1); return host, int(port)

def _idle(hub, n):
    "`n` connections that never answer the challenge"
    socks = [socket.create_connection(_address(hub)) for _ in range(n)]
    for s in socks: s.settimeout(60)                  # a safety net against a hang, not a synchronisation
    return socks

def _closed_by_hub(sock)->bool:
    "Read until the hub closes the connection (the challenge comes first); True once it did (a reset: closed with bytes unread)"
    try:
        while sock.recv(4096): pass
    except ConnectionResetError: pass
    return True

def _records_message(records, sender='test', dropped=0)->bytes:
    return json.dumps({'type': 'records', 'sender': sender, 'dropped': dropped, 'records': records}).encode()

def _flushed(sock):
    "Ask the hub to confirm that everything sent before was handled; wait for its answer"
    sock.sendall(wire.frame(b'{"type":"flush"}'))
    assert json.loads(wire.read_frame(sock)) == {'type': 'flushed'}

def _steps(got): return [r['step'] for r in got if r.get('kind') == 'step']

# --- concurrency: idle connections never keep an authenticated rank out -------------------------------------------
@pytest.mark.parametrize('num_idle', [1, 300])
def test_idle_connections_do_not_stop_an_authenticated_rank(num_idle):
    hub, got = monitor.serve(), []
    monitor.add_listener(got.append)
    idle = _idle(hub, num_idle)
    fwd = monitor.Forwarder(hub.address, hub.key)
    for step in range(50): fwd({'kind': 'step', 'rank': 0, 'step': step})
    fwd.flush()                                                      # returns once the hub delivered all 50
    assert _steps(got) == list(range(50)) and hub.num_open == 1 and fwd.num_dropped == 0
    fwd.close()
    for s in idle: s.close()

def _emit_steps(num_steps):
    rank = int(os.environ.get('RANK', 0))
    for step in range(num_steps): monitor.emit('step', rank=rank, step=step)

def test_launched_ranks_deliver_everything_while_300_connections_sit_idle():
    from accelerate import notebook_launcher
    from flexrt.launch import free_port
    hub, got = monitor.serve(), []
    monitor.add_listener(got.append)
    idle = _idle(hub, 300)
    notebook_launcher(_emit_steps, (20,), num_processes=2, use_port=str(free_port()))
    by_rank = {r: [x['step'] for x in got if x['rank'] == r] for r in (0, 1)}
    assert by_rank == {0: list(range(20)), 1: list(range(20))} and hub.num_connections == 2
    for s in idle: s.close()

def test_a_connection_that_never_authenticates_is_closed_after_the_deadline():
    hub = monitor.Hub(handshake_timeout=0.3)
    [idle] = _idle(hub, 1)
    assert len(wire.read_frame(idle)) == 32                          # the challenge
    assert _closed_by_hub(idle) and hub.num_refused == 1 and hub.num_open == 0
    hub.close()

@pytest.mark.parametrize('first_frame', [wire.frame(b'\0' * 32), wire.frame(b'x' * 33), b'\xff\xff\xff\xff' + b'a' * 8,
                                         wire.frame(pickle.dumps(('records', 'x', [], 0)))])
def test_a_wrong_handshake_is_closed_at_once(first_frame):
    hub = monitor.Hub(handshake_timeout=3600)                        # the deadline cannot be what closes it
    [sock] = _idle(hub, 1)
    wire.read_frame(sock); sock.sendall(first_frame)
    assert _closed_by_hub(sock) and hub.num_refused == 1
    hub.close()

def test_a_large_frame_before_authenticating_is_closed_unbuffered():
    "A peer without the key may announce at most a handshake's 64 bytes; 1 MiB is refused at its header, the rest never read"
    hub, got = monitor.Hub(handshake_timeout=3600), []                # the deadline cannot be what closes it
    monitor.add_listener(got.append)
    [bad] = _idle(hub, 1)
    wire.read_frame(bad)                                             # the challenge: the hub serves this connection
    bad.sendall((1 << 20).to_bytes(4, 'big') + b'a' * 4096)          # announces 1 MiB, sends its start
    good, _ = wire.connect(_address(hub), hub.key)                   # served after the bad frame's bytes were there
    good.sendall(wire.frame(_records_message([{'kind': 'step', 'step': 1}]))); _flushed(good)
    assert hub.num_refused == 1 and hub.num_open == 1, ('the hub keeps buffering an unauthenticated 1 MiB frame', hub.stats())
    assert _closed_by_hub(bad) and _steps(got) == [1]
    bad.close(); good.close(); hub.close()

def test_unauthenticated_connections_beyond_the_cap_close_the_oldest():
    hub = monitor.Hub(handshake_timeout=3600, max_pending=5)
    socks = _idle(hub, 8)
    assert all(_closed_by_hub(s) for s in socks[:3])                 # the three oldest made room
    assert hub.num_refused == 3
    sock, _ = wire.connect(_address(hub), hub.key)                   # and a rank still gets in
    _flushed(sock)
    assert hub.num_open == 1
    for s in socks + [sock]: s.close()
    hub.close()

# --- data only: pickles, oversized and malformed messages -----------------------------------------------------------
class _Payload:
    "Unpickling this runs code: it creates `path`"
    def __init__(self, path): self.path = path
    def __reduce__(self): return (open, (self.path, 'w'))

@pytest.mark.parametrize('protocol', range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickle_from_a_key_holder_is_never_unpickled(tmp_path, protocol):
    hub, got = monitor.Hub(), []
    monitor.add_listener(got.append)
    sock, _ = wire.connect(_address(hub), hub.key)                   # a process that holds the key
    marker = tmp_path / 'executed'
    for message in [_Payload(str(marker)), ('records', 'evil', [{'kind': 'step', 'step': 0, 'x': _Payload(str(marker))}], 0)]:
        sock.sendall(wire.frame(pickle.dumps(message, protocol=protocol)))
    sock.sendall(wire.frame(_records_message([{'kind': 'step', 'step': 1}]))); _flushed(sock)
    assert not marker.exists() and hub.num_malformed == 2 and _steps(got) == [1]
    sock.close(); hub.close()

def test_an_oversized_message_is_refused_and_later_records_arrive():
    hub, got = monitor.Hub(max_message_bytes=1 << 16), []
    monitor.add_listener(got.append)
    sock, limit = wire.connect(_address(hub), hub.key)
    assert limit == 1 << 16
    big = _records_message([{'kind': 'step', 'step': 0, 'blob': 'x' * (1 << 20)}])
    sock.sendall(wire.frame(big) + wire.frame(_records_message([{'kind': 'step', 'step': 1}]))); _flushed(sock)
    assert hub.num_oversized == 1 and _steps(got) == [1] and hub.num_received == 1
    sock.close(); hub.close()

def test_a_record_too_large_is_dropped_and_counted_at_the_rank():
    hub, got = monitor.serve(max_message_bytes=1 << 16), []
    monitor.add_listener(got.append)
    fwd = monitor.Forwarder(hub.address, hub.key)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        fwd({'kind': 'step', 'step': 0}); fwd({'kind': 'step', 'step': 1, 'blob': 'x' * (200 << 10)})
        fwd({'kind': 'step', 'step': 2, 'fn': print}); fwd({'kind': 'step', 'step': 3}); fwd.flush()
    assert _steps(got) == [0, 3] and fwd.num_unsendable == 2 and hub.num_dropped == 2
    assert sum('were dropped' in str(w.message) or 'was dropped' in str(w.message) for w in caught) == 1
    told = [r for r in got if r['kind'] == 'error']                  # once, for a dashboard to list
    assert [r['source'] for r in told] == ['monitor forwarder'] and 'a record of' in told[0]['error']
    fwd.close()

def _malformed():
    "(payload, how many drops the hub counts): every field x wrong type, non-objects, non-JSON, truncations"
    good = _records_message([{'kind': 'step', 'step': 99}])
    cases = [(b'', 1), (b'\xff\xfe\x00', 1), (b'[' * 100_000, 1), (b'not json', 1)]
    cases += [(json.dumps(v).encode(), 1) for v in ([], [1, 2], 'records', 1, 1.5, None, True)]
    cases += [(json.dumps({'type': t}).encode(), 1) for t in (None, 'exec', 1, ['records'])]
    base = {'type': 'records', 'sender': 's', 'dropped': 0, 'records': []}
    wrong = {'sender': (1, None, [], {}), 'dropped': ('1', -1, 1.5, None, True), 'records': ({}, 'r', None, 1)}
    for name, values in wrong.items():
        cases += [(json.dumps({**base, name: v}).encode(), 1) for v in values]
        cases.append((json.dumps({k: v for k, v in base.items() if k != name}).encode(), 1))
    cases += [(good[:cut], 1) for cut in range(1, len(good), 3)]
    bad_records = [1, 'x', None, [], {'step': 1}, {'kind': 5}, {'kind': None}, {'kind': ['step']}]
    cases.append((_records_message(bad_records + [{'kind': 'step', 'step': 98}]), len(bad_records)))
    return cases

def test_malformed_messages_are_dropped_and_counted_and_later_records_arrive():
    hub, got = monitor.Hub(), []
    monitor.add_listener(got.append)
    sock, _ = wire.connect(_address(hub), hub.key)
    cases = _malformed()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for payload, _ in cases: sock.sendall(wire.frame(payload))
        sock.sendall(wire.frame(_records_message([{'kind': 'step', 'step': 100}]))); _flushed(sock)
    assert hub.num_malformed == sum(n for _, n in cases) and _steps(got) == [98, 100]
    assert sum('Hub.num_malformed' in str(w.message) for w in caught) == 1    # one warning for the connection
    assert hub.num_open == 1                                         # the connection was not dropped for it
    sock.close(); hub.close()

def test_the_hub_keeps_serving_other_ranks_while_one_misbehaves():
    hub, got = monitor.Hub(), []
    monitor.add_listener(got.append)
    bad, _ = wire.connect(_address(hub), hub.key)
    good, _ = wire.connect(_address(hub), hub.key)
    bad.sendall(wire.frame(b'{"type":"records"') [:-3])              # a frame cut short: the hub waits for its rest
    good.sendall(wire.frame(_records_message([{'kind': 'step', 'step': 1}]))); _flushed(good)
    assert _steps(got) == [1]
    bad.close(); good.close(); hub.close()

def test_a_kernel_that_never_answers_costs_a_rank_at_most_the_flush_timeout():
    hub, never = monitor.serve(), __import__('threading').Event()
    def blocked(record): never.wait()
    monitor.add_listener(blocked)
    fwd = monitor.Forwarder(hub.address, hub.key)
    fwd({'kind': 'step', 'step': 0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        fwd.flush(timeout=0.5)                                       # returns: the test would hang otherwise
    assert any('did not confirm delivery within 0.5 s' in str(w.message) for w in caught)
    for step in range(1, 100): fwd({'kind': 'step', 'step': step})   # emitting goes on
    assert fwd._closed and len(fwd.buffer) == 99
    never.set(); fwd.close()

def test_records_pipelined_right_behind_the_handshake_answer_arrive():
    hub, got = monitor.Hub(), []
    monitor.add_listener(got.append)
    sock = socket.create_connection(_address(hub)); sock.settimeout(60)
    records = wire.frame(_records_message([{'kind': 'step', 'step': s, 'pad': 'x' * 200} for s in range(3)]))
    sock.sendall(wire.frame(wire.answer(hub.key, wire.read_frame(sock))) + records)   # one write: answer and records
    assert json.loads(wire.read_frame(sock))['type'] == 'welcome'
    _flushed(sock)
    assert _steps(got) == [0, 1, 2] and hub.num_refused == 0
    sock.close(); hub.close()
