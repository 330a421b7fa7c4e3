"""Toy evaluator: partial credit for writing one word into a file (prints {"score": x} last).

    python check.py FILE EXPECTED [--fail-rate P]

0 without the file; else 0.2 for the file plus 0.8 x the similarity of its stripped text to
EXPECTED (difflib ratio), so a near miss earns more than a wrong word. With probability P it
crashes instead, the way a flaky evaluator does (the execution is then excluded, not scored).
"""

import argparse
import difflib
import random
import sys
from pathlib import Path

from gyre.common import jsonio


def score_text(text: str | None, expected: str) -> float:
    if text is None:
        return 0.0
    return round(0.2 + 0.8 * difflib.SequenceMatcher(None, text.strip(), expected).ratio(), 4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("expected")
    p.add_argument("--fail-rate", type=float, default=0.0)
    a = p.parse_args()
    if random.random() < a.fail_rate:
        sys.exit("toy evaluator: simulated infrastructure failure")
    path = Path(a.file)
    print(jsonio.dumps({"score": score_text(path.read_text(errors="replace") if path.is_file() else None, a.expected)}))


if __name__ == "__main__":
    main()
