#!/bin/bash
# reward.json with a "reward" key (and a detail key the reader ignores).
got=$(tr -d '[:space:]' < "/app/$EXPECTED_FILE" 2>/dev/null)
want=$(wc -w < /app/words.txt | tr -d '[:space:]')
if [ "$got" = "$want" ]; then r=1.0; else r=0.0; fi
echo "{\"reward\": $r, \"expected\": $want}" > /logs/verifier/reward.json
