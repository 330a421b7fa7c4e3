#!/bin/bash
[ "$(cat done.txt 2>/dev/null)" = done ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
