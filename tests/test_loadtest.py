"""The soak's bookkeeping (the soak itself is `python -m bench.loadtest`, not a CI test)."""

from types import SimpleNamespace

from bench.loadtest import Checker, _jobs, rss_summary


def _res(ids, ties=()):
    return SimpleNamespace(token_ids=list(ids), metrics={"near_tie_positions": list(ties)})


def test_checker_counts_mismatches_near_ties_and_replays():
    refs = {0: _res([1, 2, 3, 4], ties=[2])}
    c = Checker(refs)
    c.check((0, None, 0), _res([1, 2, 3, 4]))                 # identical
    c.check((0, None, 0), _res([1, 2, 9, 9]))                 # diverges at a near-tie
    c.check((0, None, 0), _res([1, 7, 3, 4]))                 # diverges elsewhere: a bug
    job = (0, {"temperature": 0.8}, 100)
    c.check(job, _res([5, 6]))
    c.check(job, _res([5, 6]))
    c.check(job, _res([5, 7]))                                # a seeded replay differs
    s = c.stats
    assert (s["generations"], s["mismatches"], s["near_tie_divergences"],
            s["replay_mismatches"]) == (6, 1, 1, 1)


def test_job_mix_and_rss_growth():
    assert len(_jobs(3, sampled=False)) == 3 and len(_jobs(3, sampled=True)) == 6
    curve = [(0, 100.0), (10, 150.0), (40, 200.0), (600, 210.0)]
    r = rss_summary(curve, duration=600)
    assert r["rss_mb_after_warmup"] == 210.0 and r["rss_growth_after_warmup"] == 0.0
    r = rss_summary(curve, duration=100)                      # warm-up = 30 s
    assert r["rss_mb_after_warmup"] == 200.0
    assert abs(r["rss_growth_after_warmup"] - 0.05) < 1e-12
