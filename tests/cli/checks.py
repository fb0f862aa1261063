"""The checks of the CLI test scripts that report each check as a line (test_cli_bench.py,
test_cli_bench_torch2.py): `check` prints ok / FAIL and records failures, `finish` prints the
summary and returns the script's exit status."""

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def finish():
    if failures:
        print("%d check(s) failed" % len(failures))
        return 1
    print("all checks passed")
    return 0
