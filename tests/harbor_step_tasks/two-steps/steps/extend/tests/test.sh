#!/bin/bash
# The extend step's verifier, over the task's tests/: notes.txt holds "one" then "two" ($WANT lines,
# from [steps.verifier].env; $NOTES from the task's [verifier].env) and the create step's
# environment is this one (its mark in /tmp is still there).
source /tests/lines.sh
ok=0; lines "$WANT" && ok=1
same=0; [ -f /tmp/created-mark ] && same=1
echo "{\"reward\": $((ok * same)), \"lines\": $(wc -l < "$NOTES" 2>/dev/null || echo 0), \"same_environment\": $same}" > /logs/verifier/reward.json
