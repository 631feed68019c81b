"""The generated test sets (tests/test_config_fuzz.py) run a sample in `make test` and whole in `make test-all`.

    cases = sample('wrong types', CASES, strata=[block_of, kind_of])   # the params of one parametrize

A sample holds, for each function in `strata`, at least one case of every value that function takes over the whole
set (every field, every block, every wrong-type kind, ...), topped up at random to `FRACTION` of the set. It is drawn
with one seed per run, a new one each run unless given, printed in pytest's header and at the end of its report, so
the part beyond the strata rotates from run to run and a failure can be repeated:

    FLEXRT_FUZZ_SEED=<int>    the sample of that seed (the one a failing run printed)
    FLEXRT_FUZZ_SEED=random   a fresh seed (the default)
    FLEXRT_FUZZ_ALL=1         every case (make test-all, nightly)
"""
import os, random

FRACTION = 0.2   # of each set, at the least, besides the cases the strata need

def _seed()->int:
    given = os.environ.get('FLEXRT_FUZZ_SEED', '').strip() or 'random'
    if given == 'random': return random.SystemRandom().randrange(10**6)
    try: return int(given)
    except ValueError: raise ValueError(f"FLEXRT_FUZZ_SEED must be an integer or 'random', got {given!r}") from None

ALL = os.environ.get('FLEXRT_FUZZ_ALL', '').strip() not in ('', '0')
SEED = _seed()
RUN = {}   # set name -> (cases run, cases generated), for the report

def sample(name:str, # names the set in the report; with SEED, picks its sample
           cases:list, # the whole generated set
           strata:list=(), # functions of a case: every value each one takes over `cases` is in the sample
           fraction:float=FRACTION)->list: # the cases to run, in their generated order
    "`cases` whole under FLEXRT_FUZZ_ALL=1, else a stratified sample drawn with SEED"
    if ALL: picked = list(cases)
    else:
        order = random.Random(f'{SEED}/{name}').sample(range(len(cases)), len(cases))
        keys = lambda i: {(j, f(cases[i])) for j, f in enumerate(strata)}
        chosen, seen = set(), set()
        for i in order:                                   # one case for each stratum not covered yet
            if keys(i) - seen: chosen.add(i); seen |= keys(i)
        for i in order:                                   # then at random, up to the fraction
            if len(chosen) >= fraction * len(cases): break
            chosen.add(i)
        picked = [cases[i] for i in sorted(chosen)]
    RUN[name] = (len(picked), len(cases))
    return picked

def describe()->str:
    "One line on how the generated sets are sampled in this run"
    if ALL: return 'flexrt fuzz: every generated config case (FLEXRT_FUZZ_ALL=1)'
    return (f'flexrt fuzz: seed {SEED} (FLEXRT_FUZZ_SEED={SEED} repeats this sample), a stratified sample of each '
            f'generated config set (every field; FLEXRT_FUZZ_ALL=1 or make test-all for every case)')
