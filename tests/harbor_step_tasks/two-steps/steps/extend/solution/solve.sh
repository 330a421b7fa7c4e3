#!/bin/bash
# The extend step's oracle: runs in the environment the create step left.
echo two >> notes.txt
