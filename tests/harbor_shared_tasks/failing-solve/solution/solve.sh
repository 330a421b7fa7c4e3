#!/bin/bash
# Does the work, then fails: Harbor logs the exit status and lets the verifier decide.
echo done > done.txt
exit 3
