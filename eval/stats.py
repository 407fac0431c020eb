"""Intervals for the standard evaluation: accuracy with a Wilson interval, and the paired
sparse-minus-full difference with a cluster bootstrap.

Questions over one haystack share its text and depths, so they are not independent. The
paired difference is therefore resampled by haystack (cluster bootstrap): each resample draws
haystacks with replacement and takes every question of each. The Wilson interval treats the
questions as independent (it is the usual per-question figure); the report says so.
"""
import math
import random

Z95 = 1.959963984540054


def wilson(correct, n, z=Z95):
    """(low, high) of the Wilson score interval for correct/n; (0, 1) when n == 0."""
    if n == 0:
        return 0.0, 1.0
    if not 0 <= correct <= n:
        raise ValueError(f"correct={correct} is outside [0, n={n}]")
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(pairs_by_cluster, resamples=10000, seed=0, level=0.95, binary=False):
    """pairs_by_cluster: {cluster: [(a, b), ...]} with a, b numbers (1/0 for correct/wrong, or
    a continuous score), the same question under condition A and B. Returns the mean of b - a
    over all pairs and its percentile interval from a cluster bootstrap:
    {"n": pairs, "clusters": k, "diff": mean, "low": ., "high": .}.

    binary: the bootstrap cannot see a rate it never observed (no discordant pair gives
    [0, 0], nor does a haystack whose one loss and one gain cancel); where no haystack shows
    a net loss the low end is at most diff - 3/n, where none shows a net gain the high end at
    least diff + 3/n (the rule of three: with no event in n trials the 95% upper bound of its
    rate is about 3/n)."""
    clusters = [v for _, v in sorted(pairs_by_cluster.items()) if v]
    n = sum(len(v) for v in clusters)
    if n == 0:
        return {"n": 0, "clusters": 0, "diff": 0.0, "low": None, "high": None}
    sums = [sum(b - a for a, b in v) for v in clusters]
    counts = [len(v) for v in clusters]
    diff = sum(sums) / n
    if len(clusters) < 2:
        return {"n": n, "clusters": len(clusters), "diff": diff, "low": None, "high": None}
    rng = random.Random(seed)
    k = len(clusters)
    stats = []
    for _ in range(resamples):
        s = c = 0
        for _ in range(k):
            i = rng.randrange(k)
            s += sums[i]
            c += counts[i]
        stats.append(s / c)
    stats.sort()
    tail = (1 - level) / 2
    lo = stats[int(math.floor(tail * (resamples - 1)))]
    hi = stats[int(math.ceil((1 - tail) * (resamples - 1)))]
    if binary:
        if not any(s < 0 for s in sums):
            lo = min(lo, diff - 3 / n)
        if not any(s > 0 for s in sums):
            hi = max(hi, diff + 3 / n)
    return {"n": n, "clusters": k, "diff": diff, "low": lo, "high": hi}


def verdict(diff, margin=0.05):
    """A plain verdict on an accuracy difference (fractions; from paired_difference).

    "no measurable loss": the interval includes 0 and lies above -margin;
    "loss of X ± Y points": the interval lies below 0;
    "not enough evidence": anything else (the interval is too wide to say, or has no bounds);
    "gain ...": the interval lies above 0 (reported as such rather than hidden)."""
    lo, hi = diff.get("low"), diff.get("high")
    if lo is None or hi is None:
        return "not enough evidence"
    half = (hi - lo) / 2 * 100
    if hi < 0:
        return f"loss of {-diff['diff'] * 100:.1f} ± {half:.1f} points"
    if lo > 0:
        return f"gain of {diff['diff'] * 100:.1f} ± {half:.1f} points"
    if lo >= -margin:
        return "no measurable loss"
    return "not enough evidence"
