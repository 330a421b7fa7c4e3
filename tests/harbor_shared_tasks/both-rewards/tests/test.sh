#!/bin/bash
# As several Harbor adapters do: a reward.txt of 0 first (a crash still leaves a reward), then a
# reward.json with the reward and its breakdown. Harbor reads reward.json when it exists, so the
# oracle scores 1; a verifier that read reward.txt first would score it 0.
echo 0 > /logs/verifier/reward.txt
passed=0
for f in a.txt b.txt; do [ "$(cat $f 2>/dev/null)" = ok ] && passed=$((passed + 1)); done
reward=$([ $passed -eq 2 ] && echo 1 || echo 0)
echo "{\"reward\": $reward, \"tests_passed\": $passed, \"tests_total\": 2}" > /logs/verifier/reward.json
