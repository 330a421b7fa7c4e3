#!/bin/bash
wc -w < words.txt > count.txt
