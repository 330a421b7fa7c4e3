"""Per step (of the batch its group was admitted for), the main agent's turns that are neither a
well-formed toy tool call nor "Done": a sign that the policy is losing its format (the toy harness's
tools; byte tokenizer runs).

    .venv/bin/python tools/probe/malformed_turns.py RUN_DIR [RUN_DIR ...]   # step:malformed/turns ...
"""

import re
import sys
from collections import Counter, defaultdict

from omegaconf import OmegaConf

from gyre.common.run_paths import RunPaths
from gyre.records.io import read_records

TOOL_CALL = re.compile(r'\{"name": "(run|write_file|read_file|subagent|spawn_subagent)", "arguments": \{')


def main() -> None:
    for run_dir in sys.argv[1:]:
        groups_per_step = OmegaConf.load(RunPaths(run_dir).config).coordinator.groups_per_step
        per_step: dict[int, Counter] = defaultdict(Counter)
        for path in sorted(RunPaths(run_dir).records.glob("g*.jsonl")):
            step = int(path.name[1:6]) // groups_per_step  # execution g00012-3 is of group 12
            for r in read_records(path)[0]:
                if r.agent_id == "main":
                    text = bytes(t for t in r.output_ids.tolist() if t < 256).decode(errors="replace")
                    per_step[step][not (TOOL_CALL.search(text) or text.strip().startswith("Done"))] += 1
        print(run_dir, " ".join(f"{k}:{c[True]}/{c[True] + c[False]}" for k, c in sorted(per_step.items())))


if __name__ == "__main__":
    main()
