#!/bin/bash
echo ok > a.txt
echo ok > b.txt
