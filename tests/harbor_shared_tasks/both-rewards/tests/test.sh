#!/bin/bash
# As several Harbor adapters do: reward.txt holds the reward, reward.json the breakdown.
passed=0
for f in a.txt b.txt; do [ "$(cat $f 2>/dev/null)" = ok ] && passed=$((passed + 1)); done
reward=$([ $passed -eq 2 ] && echo 1 || echo 0)
echo $reward > /logs/verifier/reward.txt
echo "{\"reward\": $reward, \"tests_passed\": $passed, \"tests_total\": 2}" > /logs/verifier/reward.json
