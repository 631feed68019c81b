"""Where one training step's time goes: a timeline of flexrt's engine phases and every collective, on 2 gloo ranks.

    python bench/step_timeline.py [--stage 3] [--mlp-width 512] [--mlp-layers 8] [--mlp-batch 32]
                                  [--steps 5] [--warmup 3] [--threads 1] [--bucket 4194304] [--out FILE.json]

Trains bench/engine_step.py's communication-bound MLP (its model, batches, optimizer and config, imported from
there) with flexrt at ZeRO stage `--stage` on 2 gloo ranks, with the comms logger on for every op
(`comms_logger: {enabled: true, prof_all: true}`) and `wall_clock_breakdown: true`. After `--warmup` steps it times
`--steps` steps and prints, for the median one on rank 0, each interval in order with its start and end in ms from
the step's start:

- the engine's phases (forward, backward, allreduce: waiting for the reduced gradients, step: the optimizer) from
  the engine's timers (`Timers.intervals`), and the gaps between them (the loss, Python around the calls);
- each collective from the comms logger's timeline (`CommsLogger.timeline`): its log name, bytes, when it was
  issued, when the training thread began to wait for it, when it finished; of its time in flight, how much the
  training thread was blocked waiting for it and how much overlapped with whatever the thread did meanwhile.
  A synchronous op blocks its caller throughout. An op without a future (gloo's point-to-point messages, flexrt's
  `*_p2p` collectives) is seen to finish when a wait or a poll finds it done, so its overlapped part is the time
  from its issue to that wait: an upper bound of the real overlap.

Then the summary of that step: step time = compute (the training thread not waiting for communication, Python
included) + blocked in communication (the union of the thread's waits, from each wait's start to its return: it
includes the thread's wake-up after an op finished, shown apart); communication in flight (the union of the ops'
spans) and the part of it that overlapped with compute (no wait of the thread under way); the same per phase, and
per op (count, bytes, in flight, blocked, overlapped; per-op sums may exceed the step's unions when ops run
concurrently). A last line gives the medians of
the summary over all measured steps. Each step is the time around `loss = mse(engine(x), y); engine.backward(loss);
engine.step()`; an op in flight across a step boundary (issued in one step, waited for in the next) is counted in
each step for the part that falls inside it.

`--out FILE.json` writes Chrome's trace-event format (open it in chrome://tracing or https://ui.perfetto.dev): one
process per rank, the training thread's steps, phases and waits on one track, the ops in flight on as many lanes
as overlap; the analysed steps of both ranks are under the key `flexrtSteps`.

Only public pieces are read (the comms logger's records and the engine's timers), so the same command measures a
tree before and after a change to the ZeRO code. Timings on a shared machine vary: compare runs on the same one.
"""
import argparse, dataclasses, json, os, socket, statistics, sys, threading, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_step as es   # the MLP, its batches, optimizer and engine config (sets DS_ACCELERATOR=cpu)
import torch
import torch.multiprocessing as mp

# ---------------------------------------------------------------- measuring, on each rank
def workload(stage=3, mlp_width=512, mlp_layers=8, mlp_batch=32, steps=5, warmup=3, threads=1, bucket=2 ** 22, **_):
    "The arguments `measure` and engine_step's builders read, as an argparse namespace"
    return argparse.Namespace(workload='mlp', stage=stage, mlp_width=mlp_width, mlp_layers=mlp_layers, mlp_batch=mlp_batch,
                              steps=steps, warmup=warmup, threads=threads, bucket=bucket)

def timeline_config(args)->dict:
    "engine_step's config for `args.stage`, with every collective logged and the engine's phases timed"
    return {**es.ds_config(args, args.stage), 'wall_clock_breakdown': True,
            'comms_logger': {'enabled': True, 'prof_all': True, 'verbose': False, 'debug': False}}

def comm_record(index, iv)->dict:
    "One `CommInterval` of the comms logger's timeline as a plain dict"
    return dict(index=index, **dataclasses.asdict(iv))

def measure(rank, world_size, args)->dict:
    "Train the MLP with flexrt on this rank (process group started); the raw phases, collectives and step windows"
    import flexrt
    from flexrt import comm
    torch.set_num_threads(args.threads)
    model = es.make_model(args)
    comm.reset_log()
    engine, *_ = flexrt.initialize(model=model, optimizer=es.adamw(model), config=timeline_config(args))
    step, thread, windows = es.engine_step(engine), threading.get_ident(), []
    try:
        for i in range(args.warmup + args.steps):
            x, y = es.batch(i, rank, args)
            start = time.perf_counter(); step(x, y); end = time.perf_counter()
            if i >= args.warmup: windows.append((start, end))
        stats = comm.comms_logger.summary()   # finishes what is still in flight, so every record has its end
        comms = [comm_record(i, iv) for i, iv in enumerate(comm.comms_logger.timeline)]
        phases = [p for p in engine.timers.intervals if p[1] >= windows[0][0]]
    finally: engine.close()
    return dict(rank=rank, world_size=world_size, thread=thread, windows=windows, phases=phases, comms=comms,
                logged_calls=int(stats['count'].sum()))

# ---------------------------------------------------------------- analysing one step
def union(spans)->list:
    "The union of (start, end) spans as sorted disjoint spans"
    out = []
    for s, e in sorted(sp for sp in spans if sp[1] > sp[0]):
        if out and s <= out[-1][1]: out[-1][1] = max(out[-1][1], e)
        else: out.append([s, e])
    return out

def length(spans)->float: return sum(e - s for s, e in union(spans))

def overlap(a, b)->float:
    "Total length of the intersection of two sets of spans"
    return sum(max(0., min(e1, e2) - max(s1, s2)) for s1, e1 in union(a) for s2, e2 in union(b))

def comm_interval(r:dict, t0:float, t1:float, thread:int)->dict:
    "Record `r` within the step [t0, t1]: its span in flight, the part of it the training thread `thread` waited, that wait"
    c0, c1 = max(r['issued'], t0), min(r['end'] if r['end'] is not None else t1, t1)
    if r['wait_start'] is None or r['wait_thread'] != thread: return dict(r, span=(c0, c1), blocked_span=(c1, c1), wait_span=None)
    b0, w1 = max(r['wait_start'], c0), min(t1, next(t for t in (r['wait_end'], r['end'], t1) if t is not None))
    w0 = max(r['wait_start'], t0)
    return dict(r, span=(c0, c1), blocked_span=(b0, max(b0, c1)), wait_span=(w0, max(w0, w1)))

def intervals(window, phases, comms, thread)->list:
    "The step's phases, the gaps between them and the collectives in flight, ordered by start (seconds, absolute)"
    t0, t1 = window
    mine = [dict(kind='phase', name=n, start=s, end=e) for n, s, e in phases if s >= t0 and e <= t1]
    edges = [t0] + [x for p in mine for x in (p['start'], p['end'])] + [t1]
    gaps = [dict(kind='gap', name='(between phases)', start=s, end=e) for s, e in zip(edges[::2], edges[1::2]) if e > s]
    ops = [comm_interval(r, t0, t1, thread) for r in comms
           if r['issued'] <= t1 and (r['end'] is None or r['end'] >= t0)]
    for o in ops: o.update(kind='comm', start=o['span'][0], end=o['span'][1])
    return sorted(mine + gaps + ops, key=lambda i: (i['start'], i['kind'] != 'phase', i.get('index', 0)))

def summarise(window, items)->dict:
    "Step, compute, blocked and overlapped time of one step (ms), overall, per phase and per op"
    ms, (t0, t1) = 1e3, window
    ops = [i for i in items if i['kind'] == 'comm']
    waits, flight = [o['wait_span'] for o in ops if o['wait_span']], [o['span'] for o in ops]
    blocked_in_flight = overlap(flight, waits) * ms
    total = dict(step_ms=(t1 - t0) * ms, blocked_ms=length(waits) * ms, comm_ms=length(flight) * ms)
    total.update(compute_ms=total['step_ms'] - total['blocked_ms'], overlapped_ms=total['comm_ms'] - blocked_in_flight,
                 wake_ms=total['blocked_ms'] - blocked_in_flight)
    phases = {}
    for p in (i for i in items if i['kind'] != 'comm'):
        d = phases.setdefault(p['name'], dict(ms=0., blocked_ms=0.))
        d['ms'] += (p['end'] - p['start']) * ms; d['blocked_ms'] += overlap([(p['start'], p['end'])], waits) * ms
    per_op = {}
    for o in ops:
        d = per_op.setdefault(o['name'], dict(count=0, bytes=0, comm_ms=0., blocked_ms=0., overlapped_ms=0.))
        f, b = (o['span'][1] - o['span'][0]) * ms, (o['blocked_span'][1] - o['blocked_span'][0]) * ms
        d['count'] += 1; d['bytes'] += o['size']; d['comm_ms'] += f; d['blocked_ms'] += b; d['overlapped_ms'] += f - b
    return dict(total=total, phases=phases, ops=per_op)

def analyse(raw:dict)->list:
    "One dict per measured step of a rank's `measure` result: its intervals (ms from the step's start) and summary"
    out = []
    for k, window in enumerate(raw['windows']):
        items = intervals(window, raw['phases'], raw['comms'], raw['thread'])
        rel = lambda t: None if t is None else (t - window[0]) * 1e3
        for i in items:
            i['start_ms'], i['end_ms'] = rel(i['start']), rel(i['end'])
            if i['kind'] == 'comm':
                i.update(issued_ms=rel(i['issued']), wait_ms=rel(i['wait_start']) if i['wait_thread'] == raw['thread'] else None,
                         finished_ms=rel(i['end']), in_flight_ms=(i['span'][1] - i['span'][0]) * 1e3,
                         blocked_ms=(i['blocked_span'][1] - i['blocked_span'][0]) * 1e3)
                i['overlapped_ms'] = i['in_flight_ms'] - i['blocked_ms']
        out.append(dict(step=k, start=window[0], intervals=items, **summarise(window, items)))
    return out

# ---------------------------------------------------------------- printing
def median_step(steps:list)->dict:
    "The step whose time is the median (the lower one for an even count)"
    order = sorted(steps, key=lambda s: s['total']['step_ms'])
    return order[(len(order) - 1) // 2]

def fmt(x, width=8): return f"{x:{width}.2f}" if x is not None else ' ' * (width - 1) + '-'

def print_timeline(step:dict, file=sys.stdout):
    "Each interval of one analysed step, in order, with offsets in ms from the step's start"
    print(f"  {'start':>8s} {'end':>8s}  {'ms':>8s}  {'interval':30s} {'bytes':>10s} {'waited@':>8s} {'blocked':>8s} {'overlap':>8s}", file=file)
    for i in step['intervals']:
        if i['kind'] == 'gap' and i['end_ms'] - i['start_ms'] < 0.01: continue   # kept in the data, not worth a line
        if i['kind'] != 'comm':
            print(f"  {fmt(i['start_ms'])} {fmt(i['end_ms'])}  {fmt(i['end_ms'] - i['start_ms'])}  [{i['name']}]", file=file)
            continue
        issued = '' if i['issued_ms'] >= 0 else f" (issued at {i['issued_ms']:.2f})"
        seen = '*' if i['finished_by'] in ('wait', 'poll') else ' '
        print(f"  {fmt(i['start_ms'])} {fmt(i['end_ms'])}{seen} {fmt(i['in_flight_ms'])}    {i['name'] + issued:28s} {i['size']:10d} "
              f"{fmt(i['wait_ms'])} {fmt(i['blocked_ms'])} {fmt(i['overlapped_ms'])}", file=file)
    if any(i.get('finished_by') in ('wait', 'poll') for i in step['intervals']):
        print("  *: an op with no completion callback (point-to-point messages): it ends when a wait saw it done, so its "
              "overlap is an upper bound", file=file)

def print_summary(step:dict, steps:list, file=sys.stdout):
    "The summary of one analysed step, per phase and per op, and the medians over all `steps`"
    t = step['total']
    print(f"  step {t['step_ms']:.2f} ms = compute {t['compute_ms']:.2f} + blocked in communication {t['blocked_ms']:.2f} "
          f"({t['wake_ms']:.2f} of it waking up after the op finished); communication in flight {t['comm_ms']:.2f}, "
          f"of it overlapped with compute {t['overlapped_ms']:.2f}", file=file)
    for name, p in step['phases'].items():
        print(f"    phase {name:18s} {p['ms']:8.2f} ms, blocked {p['blocked_ms']:8.2f}, compute {p['ms'] - p['blocked_ms']:8.2f}", file=file)
    for name, o in sorted(step['ops'].items()):
        print(f"    op {name:28s} x{o['count']:<4d} {o['bytes'] / 2**20:8.2f} MiB  in flight {o['comm_ms']:8.2f} ms, "
              f"blocked {o['blocked_ms']:8.2f}, overlapped {o['overlapped_ms']:8.2f}", file=file)
    med = {k: statistics.median(s['total'][k] for s in steps) for k in t}
    print(f"  median over {len(steps)} steps: step {med['step_ms']:.2f} ms, compute {med['compute_ms']:.2f}, "
          f"blocked {med['blocked_ms']:.2f}, in flight {med['comm_ms']:.2f}, overlapped {med['overlapped_ms']:.2f}", file=file)

def report(args, ranks:list, file=sys.stdout):
    "Print rank 0's median step: the header, the timeline, the summary"
    steps = analyse(ranks[0])
    step = median_step(steps)
    numel = args.mlp_layers * (args.mlp_width + 1) * args.mlp_width
    print(f"flexrt ZeRO stage {args.stage}, MLP {args.mlp_layers} x Linear({args.mlp_width}, {args.mlp_width}) ({numel / 1e6:.2f}M "
          f"params), micro-batch {args.mlp_batch}/rank, {ranks[0]['world_size']} gloo ranks x {args.threads} thread; "
          f"rank 0, step {step['step']} of {len(steps)} measured (the median) after {args.warmup} warmup", file=file)
    print_timeline(step, file); print_summary(step, steps, file)
    return steps

# ---------------------------------------------------------------- Chrome trace events
def lanes(spans)->list:
    "A lane per span such that spans on one lane do not overlap (greedy, in start order)"
    ends, out = [], [0] * len(spans)
    for k in sorted(range(len(spans)), key=lambda k: spans[k][0]):
        lane = next((j for j, e in enumerate(ends) if e <= spans[k][0]), len(ends))
        if lane == len(ends): ends.append(0.)
        ends[lane], out[k] = spans[k][1], lane
    return out

def trace_events(rank:int, steps:list, origin:float)->list:
    "Chrome trace events (microseconds from `origin`) of one rank's analysed steps"
    us = lambda t: (t - origin) * 1e6
    ev = lambda name, tid, s, e, **a: dict(name=name, ph='X', pid=rank, tid=tid, ts=us(s), dur=max(0., (e - s) * 1e6), args=a)
    out = [dict(name='process_name', ph='M', pid=rank, args=dict(name=f'rank {rank}')),
           dict(name='thread_name', ph='M', pid=rank, tid=0, args=dict(name='training thread'))]
    for s in steps:
        out.append(ev(f"step {s['step']}", 0, s['start'], s['start'] + s['total']['step_ms'] / 1e3, **s['total']))
        out += [ev(i['name'], 0, i['start'], i['end']) for i in s['intervals'] if i['kind'] == 'phase']
        ops = [i for i in s['intervals'] if i['kind'] == 'comm']
        out += [ev(f"wait {o['name']}", 0, *o['blocked_span'], bytes=o['size']) for o in ops if o['blocked_ms'] > 0]
        for o, lane in zip(ops, lanes([o['span'] for o in ops])):
            out.append(ev(o['name'], 1 + lane, *o['span'], op=o['op'], bytes=o['size'], blocked_ms=o['blocked_ms'],
                          overlapped_ms=o['overlapped_ms'], finished_by=o['finished_by']))
    tids = sorted({e['tid'] for e in out if e['ph'] == 'X' and e['tid'] > 0})
    return out + [dict(name='thread_name', ph='M', pid=rank, tid=t, args=dict(name=f'comm in flight {t}')) for t in tids]

def write_trace(path, args, ranks:list):
    "Write every rank's measured steps as a Chrome trace (plus the analysed steps under `flexrtSteps`)"
    analysed = [analyse(r) for r in ranks]
    origin = min(s['start'] for steps in analysed for s in steps)
    events = [e for r, steps in zip(ranks, analysed) for e in trace_events(r['rank'], steps, origin)]
    strip = lambda i: {k: v for k, v in i.items() if k not in ('span', 'blocked_span')}
    out = dict(traceEvents=events, displayTimeUnit='ms', otherData=dict(vars(args)),
               flexrtSteps=[[dict(s, intervals=[strip(i) for i in s['intervals']]) for s in steps] for steps in analysed])
    with open(path, 'w') as f: json.dump(out, f, indent=1)

# ---------------------------------------------------------------- the command
def worker(rank, world, port, args, out=None):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from flexrt import comm
    comm.init_distributed('gloo')
    raw = measure(rank, world, args)
    ranks = [None] * world
    comm.all_gather_object(ranks, raw)
    if rank == 0:
        report(args, ranks)
        if out: write_trace(out, args, ranks); print(f"  trace of both ranks written to {out}")
    comm.destroy_process_group()

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--stage', type=int, default=3, choices=range(4), help='ZeRO stage')
    ap.add_argument('--mlp-width', type=int, default=512)
    ap.add_argument('--mlp-layers', type=int, default=8)
    ap.add_argument('--mlp-batch', type=int, default=32, help='micro-batch per rank')
    ap.add_argument('--steps', type=int, default=5, help='measured steps')
    ap.add_argument('--warmup', type=int, default=3, help='steps before the measured ones')
    ap.add_argument('--threads', type=int, default=1, help='torch threads per rank')
    ap.add_argument('--bucket', type=int, default=2 ** 22, help="reduce_bucket_size, in elements")
    ap.add_argument('--out', help='write a Chrome trace-event JSON of both ranks here')
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0: raise SystemExit("--steps must be at least 1 and --warmup at least 0")
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, workload(**vars(args)), args.out), nprocs=2)

if __name__ == '__main__':
    sys.exit(main())
