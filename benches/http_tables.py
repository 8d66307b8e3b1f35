#!/usr/bin/env python3
"""The paired tables of `benches/http_load.sh`, from the rounds it keeps
(`RESULTS=path`: one line per variant a round, `round variant requests/s µs-of-CPU`).

Given several files, their rounds are pooled: a round pairs only with the same round of
the same file, so runs need no renumbering.

    python3 benches/http_tables.py run1.txt run2.txt        # variants in the order seen
    python3 benches/http_tables.py --variants "none governor tollgate" run1.txt

For each variant, against no limiter and against governor (each when in the rounds):
the median of its per-round ratios to the baseline's same round, with an interval of
that median that covers it at least 95% of the time (the order statistics the sign test
gives, which assume only that rounds are independent; "-" under 6 rounds), for
requests/s and for server CPU per request; the geometric mean of the same ratios with a
95% t-interval of the mean log ratio (which assumes the log ratios are roughly normal,
and is tighter); and the sign test's two-sided p of the rounds ahead (ties left out). An
interval that holds 1 and a p above 0.05 say the rounds cannot tell the two apart, not
that they are equal. Against governor, no limiter's row is the rounds' calibration: how
far apart two servers must be for them to tell.

Needs python3 3.8 or later (math.comb).
"""
import math
import statistics
import sys

# Two-sided 97.5% quantiles of Student's t for 1 to 30 degrees of freedom; past 30,
# 1.96 + 2.4 / df, within 0.2% of t's (2.037 for t's 2.040 at 31, 2.000 at 60).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
        2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
        2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def read(paths):
    rounds, seen = {}, []
    for index, path in enumerate(paths):
        with open(path) as file:
            for line in file:
                fields = line.split()
                if not fields:
                    continue
                if len(fields) != 4:
                    sys.exit(f"{path}: not a line of rounds (round variant requests/s cpu): {line!r}")
                number, variant, rps, cpu = fields
                rounds.setdefault((index, number), {})[variant] = (float(rps), float(cpu))
                if variant not in seen:
                    seen.append(variant)
    return rounds, seen


def cell(values):
    """The median of `values` and its interval: (x_k, x_(n+1-k)) for the largest k whose
    coverage, 1 - 2 P(Bin(n, 1/2) < k), is at least 0.95."""
    if not values:
        return "-"
    values = sorted(values)
    n = len(values)
    median = f"{statistics.median(values):.3f}"
    best = None
    for k in range(1, n // 2 + 1):
        below = sum(math.comb(n, i) for i in range(k)) / 2**n
        if 1 - 2 * below >= 0.95:
            best = k
    if best is None:
        return f"{median} (-, n={n})"
    return f"{median} ({values[best - 1]:.3f} to {values[n - best]:.3f}, n={n})"


def geometric(values):
    """The geometric mean of `values` and the 95% t-interval of their mean log."""
    if len(values) < 2:
        return "-"
    logs = [math.log(v) for v in values]
    n = len(logs)
    mean = statistics.mean(logs)
    df = n - 1
    t = T975[df - 1] if df <= len(T975) else 1.96 + 2.4 / df
    half = t * statistics.stdev(logs) / math.sqrt(n)
    return f"{math.exp(mean):.3f} ({math.exp(mean - half):.3f} to {math.exp(mean + half):.3f})"


def sign_p(ahead, n):
    # Two-sided: both tails as far from n / 2 as `ahead` is.
    if n == 0:
        return "-"
    far = abs(ahead - n / 2)
    tail = sum(math.comb(n, k) for k in range(n + 1) if abs(k - n / 2) >= far)
    return f"{min(1.0, tail / 2**n):.3f}"


def main(argv):
    variants = None
    if len(argv) >= 2 and argv[0] == "--variants":
        variants, argv = argv[1].split(), argv[2:]
    if not argv:
        sys.exit(__doc__)
    rounds, seen = read(argv)
    variants = variants or seen
    for baseline, name in (("none", "no limiter"), ("governor", "governor")):
        if baseline not in variants:
            continue
        print()
        print(f"| server | vs {name}, requests/s (median of per-round ratios, 95% interval, rounds) "
              "| server CPU per request (same) | requests/s, geometric mean (95% t-interval) "
              "| server CPU per request (same) | rounds ahead (ties left out) | sign test p |")
        print("|---|---|---|---|---|---|---|")
        for variant in variants:
            if variant == baseline:
                continue
            pairs = [
                (v[variant], v[baseline])
                for v in rounds.values()
                if variant in v and baseline in v and v[variant][0] > 0 and v[baseline][0] > 0
            ]
            rps = [ours[0] / theirs[0] for ours, theirs in pairs]
            cpu = [ours[1] / theirs[1] for ours, theirs in pairs if ours[1] > 0 and theirs[1] > 0]
            ahead = sum(ours[0] > theirs[0] for ours, theirs in pairs)
            untied = sum(ours[0] != theirs[0] for ours, theirs in pairs)
            print(f"| {variant} | {cell(rps)} | {cell(cpu)} | {geometric(rps)} | {geometric(cpu)} "
                  f"| {ahead} of {untied} | {sign_p(ahead, untied)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
