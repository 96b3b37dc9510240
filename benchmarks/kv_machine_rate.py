"""Steps per second of the reusable-KV state machine (``tests/unit/test_kv.py``).

The machine tests ``agentkv._client.kv`` alone, with decode as a dict: no fake cluster, no
event loop. This runs it with the test's settings (or ``--examples``) and reports how many
rules it ran per second, all of hypothesis's generation included.

    .venv/bin/python benchmarks/kv_machine_rate.py [--examples 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.unit.test_kv import MACHINE_SETTINGS, KVMachine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=MACHINE_SETTINGS.max_examples)
    args = parser.parse_args()
    steps = [0]

    class Counted(KVMachine):
        def check_invariants(self, settings: object, output: object, runtimes: object) -> None:
            steps[0] += 1
            super().check_invariants(settings, output, runtimes)  # type: ignore[misc]

    chosen = settings(MACHINE_SETTINGS, max_examples=args.examples, database=None)
    started = time.perf_counter()
    run_state_machine_as_test(Counted, settings=chosen)
    elapsed = time.perf_counter() - started
    rules = steps[0] - args.examples  # invariants run once before the first step, then after each
    print(
        f"examples={args.examples} step_count<={MACHINE_SETTINGS.stateful_step_count} "
        f"steps={rules} seconds={elapsed:.2f} steps_per_s={rules / elapsed:.0f}"
    )


if __name__ == "__main__":
    main()
